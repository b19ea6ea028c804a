"""The command line, ``train(cfg)``, multirun and the exit policy. Nothing in the package imports it."""
