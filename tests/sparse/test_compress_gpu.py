"""GPU: the Triton compressor captured in a CUDA graph on layer shapes of VGG, ResNet and AlexNet (one segment a
plane and several, stride phases, fp32 and both halves, channels over capacity), replayed on new ReLU inputs with
every output buffer poisoned before each replay, against the reference."""

import pytest
import torch

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.ops.compress import reference as compress_reference
from tendril.sparse.ops.compress import triton as compress_triton
from tests.sparse.checks import assert_same_compression

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")

LAYERS = {  # channels, in_hw, stride, padding, capacity fraction
    "vgg-conv1": (3, (224, 224), 1, 1, 1.0),  # 13 segments a plane
    "resnet-stem": (3, (224, 224), 2, 3, 1.0),  # 4 phases of 4 segments
    "alexnet-conv1": (3, (227, 227), 4, 0, 1.0),  # 16 phases, one segment each
    "resnet-downsample": (64, (112, 112), 2, 1, 1.0),
    "vgg-conv3": (256, (56, 56), 1, 1, 1.0),  # one segment of several blocks
    "vgg-conv5": (512, (14, 14), 1, 1, 1.0),
    "over-capacity-single": (128, (28, 28), 1, 1, 0.1),  # a tenth of a plane: below both densities
    "over-capacity-multi": (8, (112, 112), 1, 1, 0.1),
}


def _poison(acts: CompressedActivations) -> None:
    acts.values.fill_(float("nan"))
    for buffer in (acts.positions, acts.row_ptr, acts.counts):
        buffer.fill_(-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(LAYERS))
def test_compression_replayed_in_a_cuda_graph_matches_the_reference(name, dtype):
    channels, hw, stride, padding, fraction = LAYERS[name]
    layout = ActivationLayout(channels, hw, (stride, stride), (padding, padding), 1).with_capacity(fraction)
    x = torch.zeros(channels, *hw, dtype=dtype, device=CUDA)
    flag = torch.zeros(1, dtype=torch.int32, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        compress_triton.compress(x, layout, flag)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        acts = compress_triton.compress(x, layout, flag)
    generator = torch.Generator(device=CUDA).manual_seed(channels)
    for replay, shift in enumerate((0.0, -1.0)):  # densities of about a half and a sixth
        sample = (torch.randn(channels, *hw, generator=generator, device=CUDA) + shift).relu().to(dtype)
        sample[0] = 0.0
        x.copy_(sample)
        _poison(acts)
        flag.fill_(replay)  # the second replay starts raised: the flag must stay raised
        graph.replay()
        expected = compress_reference.compress(sample.cpu(), layout)
        assert_same_compression(acts, expected)
        assert flag.item() == max(replay, int(expected.overflowed()))
        assert expected.overflowed() == (fraction < 1.0)
