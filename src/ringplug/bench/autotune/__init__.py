"""`ringplug-bench autotune`: autotune against a hand-picked sweep (see `compare`)."""
