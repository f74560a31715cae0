"""What runs inside the image under test: the runner, the probes, and the sweep the runner carries in."""
