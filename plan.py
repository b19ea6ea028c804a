"""Plan a run before paying for it: `python plan.py <the same overrides as train.py>`.

Per-device memory by category, speed and dollars; `plan.search=true` ranks configurations; `plan.format=json`.
The work is done by `lightning_trainopt.config.plan.plan(cfg)`, which tests call directly.
"""

from lightning_trainopt.launch.cli import plan_main

if __name__ == "__main__":
    plan_main()
