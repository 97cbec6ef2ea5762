"""Scripts run beside the tests: the GPU-suite runner and the Hopper compile report."""
