"""The Triton kernels (compress, conv, linear) and a converted network, under the Triton interpreter."""

from tests.utils.interpreter import run_interpreted


def test_triton_kernels_match_their_references_under_the_interpreter():
    run_interpreted("tests.sparse.interpreted", "interpreted checks passed")
