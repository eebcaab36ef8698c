"""The Triton kernels (compress, conv, linear) and a converted network, under the Triton interpreter."""

from tests.utils.interpreter import run_interpreted


def test_triton_kernels_match_their_references_under_the_interpreter():
    run_interpreted("tests.sparse.interpreted", "interpreted checks passed")


def test_both_compression_plans_match_the_reference_and_launch_only_their_kernels():
    run_interpreted("tests.sparse.interpreted_compress", "interpreted compress checks passed")
