"""Ray Tune + Optuna + Ray Train + Ray Data + MLflow study system around the `models` package."""
