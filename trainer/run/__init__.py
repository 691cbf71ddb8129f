"""A training run: `driver.train(cfg)` checks, joins the job, builds a `RunContext` and runs the loop to its stop."""
