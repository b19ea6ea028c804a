"""Train with the Hydra config tree in conf/: `python train.py +strategy=zero3 precision=bf16`.

The work is done by `lightning_trainopt.launch.train.train(cfg)`, which tests call directly.
"""

from lightning_trainopt.launch.cli import train_main

if __name__ == "__main__":
    train_main()
