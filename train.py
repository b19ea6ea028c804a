"""Train with the Hydra config tree in lightning_trainopt/conf/: `python train.py +strategy=zero3 precision=bf16`.

The work is done by `lightning_trainopt.launch.train.train(cfg)`, which tests call directly.
"""

from lightning_trainopt.launch.launcher import detect_launch, die_with_parent

# First, before the seconds that importing torch and Lightning takes: a rank whose launcher dies meanwhile must end.
die_with_parent(detect_launch())

from lightning_trainopt.launch.cli import train_main  # noqa: E402

if __name__ == "__main__":
    train_main()
