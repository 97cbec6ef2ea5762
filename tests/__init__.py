"""The library's tests, laid out as the package is: tp/, kernels/ and hf/ beside the top-level modules."""
