"""Every private attribute of torch, Lightning, Hydra and DeepSpeed that the package touches, touched here alone."""
