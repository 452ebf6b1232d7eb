"""Benchmarks of a trained language model: lm-evaluation-harness tasks (ARC, MMLU, GSM8K, ...) through the
`LapstudyLM` adapter, and HumanEval with its generated code run in a sandbox (opt-in). docs/evals.md.

In-process use (a study stage, a notebook):

    from study.evals.evaluate import evaluate_model
    metrics = evaluate_model(model, tokenizer, ["arc_easy", "mmlu"], include_path=[folder], limit=100)
    # {"eval_arc_easy_acc": ..., "eval_arc_easy_acc_norm": ..., "eval_mmlu_acc": ..., "..._stderr": ...}

`model` is a GPT (models/gpt.py), `tokenizer` the project's (study/data/text.py); `study.evals.load.load_model(config,
checkpoint)` gives both back from a run. `study.evals.sandbox.run_sample` and `pass_at_k` are usable on their own.
"""
