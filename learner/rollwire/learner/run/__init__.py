"""The run: the main loop, its named steps, assembling them from the config, checkpoints, metrics and reports."""
