"""The config read once: compose, bind keys to targets, validate, pre-flight, and the planner's inputs."""
