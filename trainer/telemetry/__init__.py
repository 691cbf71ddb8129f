"""What a run reports: metrics (metrics.jsonl, wandb, loss.png), its timeline (events.jsonl) and goodput report,
library logs and profiles."""
