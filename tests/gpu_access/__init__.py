"""GPU access tier: CDI and GPU request paths on real engines, without a GPU."""
