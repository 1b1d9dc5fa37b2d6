"""The compiled decode step (torch.compile of the model's static-shape step) and its on-disk store, so a second
process loads the step instead of compiling it."""
