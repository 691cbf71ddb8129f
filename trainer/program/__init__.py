"""What gets jitted: `TrainProgram` (the K-step train call), `Evaluator` (the loss call), and what they close over."""
