"""What this folder's modules know of the cluster they share (conftest.py's `served`)."""

KEY = "test-key-0123456789"  # its API key
MODEL = "tiny-hybrid"  # the name it serves the tiny GDN hybrid under
