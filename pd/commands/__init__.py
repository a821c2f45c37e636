"""Engine command lines: what a worker runs for its role, for the reference engine and for SGLang."""
