"""What a user runs: the command line, the demo, and the scriptable fake upstream the demo and tests use."""
