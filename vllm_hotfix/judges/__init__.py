"""The host's judges: what an image is judged by, from facts the host reads itself."""
