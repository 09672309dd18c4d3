"""Every stage's forward as a torch custom op (stages/ops.py): fake implementations and the
op checks here (meta tensors, no GPU); on a GPU, opcheck with real tensors, torch.compile with
fullgraph=True (no graph break) equal to eager, and CUDA-graph capture and replay equal to eager,
bit for bit."""

import pytest
import torch

import dsv4_attention.stages.ops as ops
from dsv4_attention import stages
from dsv4_attention.common.testing import attention_inputs, gpu_arch_params

ATTENTION = [s.id for s in stages.STAGES if s.id != "a"]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def op(stage_id):
    return ops.OPS[stage_id]


@pytest.mark.parametrize("stage_id", ATTENTION)
def test_fake_attention_shapes(stage_id):
    q, k = meta(2, 10, 8, 128), meta(2, 30, 2, 128)
    o, lse = op(stage_id)(q, k, k)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == (2, 8, 10) and lse.dtype == torch.float32


@pytest.mark.parametrize("stage_id", ["d3", "d4"])
def test_fake_varlen_shapes(stage_id):
    q, k = meta(300, 8, 128), meta(500, 2, 128)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    o, lse = op(stage_id)(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=300)
    assert o.shape == q.shape and lse.shape == (8, 300) and lse.dtype == torch.float32


def test_fake_scores_shape():
    s = op("a")(meta(2, 10, 8, 64), meta(2, 30, 8, 64))
    assert s.shape == (2, 8, 10, 30) and s.dtype == torch.float32


@pytest.mark.parametrize("stage_id", ["b", "d1", "d4"])
def test_opcheck_schema_and_fake(stage_id):
    q, k = meta(2, 10, 8, 128), meta(2, 30, 2, 128)
    torch.library.opcheck(op(stage_id), (q, k, k), test_utils=("test_schema", "test_faketensor"))


def test_export_has_no_graph_break():
    """torch.export traces whole graphs only (as torch.compile's fullgraph=True): the op is one node."""

    class Branch(torch.nn.Module):
        def forward(self, q, kv, n):
            o, lse = torch.ops.dsv4_attention.d4_causal_window(q, kv, kv, causal=True, window_left=127,
                                                              seqused_k=n)
            return o * 2, lse

    ep = torch.export.export(Branch(), (meta(1, 64, 16, 512), meta(1, 64, 1, 512), meta(1, dtype=torch.int32)))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "dsv4_attention.d4_causal_window.default" in targets


def test_arguments_a_stage_does_not_take_are_refused():
    with pytest.raises(ValueError, match="does not take causal"):
        ops._stage_kwargs(stages.get("c"), None, True, None, None, None, None)
    with pytest.raises(ValueError, match="does not take window_size"):
        ops._stage_kwargs(stages.get("d3"), None, False, 127, 0, None, None)
    assert ops._stage_kwargs(stages.get("d4"), 0.1, True, 127, None, None, None) == {
        "softmax_scale": 0.1, "causal": True, "seqused_k": None, "pack_gqa": None, "window_size": (127, None)}


# ---- on a GPU ---------------------------------------------------------------------------------


def decode_inputs():
    q, kv, _, _ = attention_inputs(4, 2, 700, 128, 1, 512, torch.bfloat16, kv_shared=True)
    n = torch.tensor([700, 1, 350, 0], dtype=torch.int32, device="cuda")
    return q, kv, n


def branch(q, kv, n):
    o, lse = torch.ops.dsv4_attention.d4_causal_window(q, kv, kv, causal=True, window_left=127, seqused_k=n)
    return o * 2, lse  # exact in bf16: compiled and eager must agree bit for bit


@pytest.mark.stage_d4
@pytest.mark.parametrize("arch", gpu_arch_params())
def test_opcheck_on_gpu(arch):
    q, kv, n = decode_inputs()
    torch.library.opcheck(op("d4"), (q, kv, kv), {"causal": True, "window_left": 127, "seqused_k": n})
    q2, k2, v2, _ = attention_inputs(2, 100, 300, 4, 2, 128, torch.bfloat16)
    torch.library.opcheck(op("c"), (q2, k2, v2))


@pytest.mark.stage_d4
@pytest.mark.parametrize("arch", gpu_arch_params())
def test_torch_compile_fullgraph_equals_eager(arch):
    q, kv, n = decode_inputs()
    eager = branch(q, kv, n)
    compiled = torch.compile(branch, fullgraph=True)(q, kv, n)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.stage_d4
@pytest.mark.parametrize("arch", gpu_arch_params())
@pytest.mark.parametrize("stage_id", ["d1", "d2", "d4"])
def test_cuda_graph_replay_equals_eager(arch, stage_id):
    q, kv, n = decode_inputs()
    kwargs = {"causal": True, "window_left": 127, "seqused_k": n} if stage_id == "d4" else {}
    assert_graph_replay_is_eager(lambda: op(stage_id)(q, kv, kv, **kwargs))


def assert_graph_replay_is_eager(call):
    """``call()``'s (o, lse) captured in a CUDA graph and replayed twice (o poisoned before each) is
    the eager call's, bit for bit."""
    o_eager, lse_eager = call()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # warm (compiled already; this keeps the capture free of first-use work)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = call()
    for _ in range(2):
        o_graph.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager)


# ---- stage E: the fused kernel (the import a user takes) -----------------------------------------


def test_fake_fused_shapes_and_schema():
    q, kv, c = meta(2, 10, 128, 512), meta(2, 30, 1, 512), meta(2, 7, 1, 512)
    o, lse = op("e")(q, kv, kv, compressed_kv=c, compress_ratio=4, causal=True, window_left=127)
    assert o.shape == q.shape and lse.shape == (2, 128, 10) and lse.dtype == torch.float32
    torch.library.opcheck(op("e"), (q, kv, kv), {"compressed_kv": c, "compress_ratio": 4},
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="does not take compressed_kv"):
        ops._stage_kwargs(stages.get("d5"), None, False, None, None, None, None, compressed_kv=c, compress_ratio=4)


def test_fake_index_mode_shapes_and_schema():
    q, kv, idx = meta(10, 128, 512), meta(30, 1, 512), torch.empty(10, 1, 16, dtype=torch.int32, device="meta")
    o, lse = ops.OPS["e_index"](q, kv, idx)
    assert o.shape == q.shape and lse.shape == (10, 128) and lse.dtype == torch.float32
    torch.library.opcheck(ops.OPS["e_index"], (q, kv, idx), test_utils=("test_schema", "test_faketensor"))


def test_fake_split_shapes_and_schema():
    """num_splits in the schemas (stage E's op and index mode's; a stage without it refuses any
    other value than 1): the fake outputs do not depend on it."""
    q, kv = meta(2, 1, 128, 512), meta(2, 3000, 1, 512)
    o, lse = op("e")(q, kv, kv, num_splits=None)
    assert o.shape == q.shape and lse.shape == (2, 128, 1)
    torch.library.opcheck(op("e"), (q, kv, kv), {"num_splits": 4}, test_utils=("test_schema", "test_faketensor"))
    qi, kvi, idx = meta(10, 128, 512), meta(30, 1, 512), torch.empty(10, 1, 16, dtype=torch.int32, device="meta")
    torch.library.opcheck(ops.OPS["e_index"], (qi, kvi, idx), {"num_splits": None},
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="does not take num_splits"):
        ops._stage_kwargs(stages.get("d5"), None, False, None, None, None, None, num_splits=4)
    assert "num_splits" not in ops._stage_kwargs(stages.get("d5"), None, False, None, None, None, None, num_splits=1)


def split_decode_branch(q, kv, sink):
    o, lse = torch.ops.dsv4_attention.e_fused(q, kv, kv, learnable_sink=sink, num_splits=None)
    return o * 2, lse


@pytest.mark.stage_e
@pytest.mark.parametrize("arch", gpu_arch_params())
def test_split_op_in_cuda_graph_and_compile_equals_eager(arch):
    """A split decode step (num_splits=None: its partial buffers allocated and merged inside the
    op) replayed from a CUDA graph and traced by torch.compile (fullgraph): bitwise the eager call."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 128, 512, generator=g).to(device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 3000, 1, 512, generator=g).to(device="cuda", dtype=torch.bfloat16)
    sink = torch.randn(128, generator=g).cuda()
    o_eager, lse_eager = split_decode_branch(q, kv, sink)
    compiled = torch.compile(split_decode_branch, fullgraph=True)(q, kv, sink)
    assert torch.equal(compiled[0], o_eager) and torch.equal(compiled[1], lse_eager)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        split_decode_branch(q, kv, sink)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = split_decode_branch(q, kv, sink)
    for _ in range(2):
        o_graph.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager)


def fused_branch(q, kv, c, sink):
    o, lse = torch.ops.dsv4_attention.e_fused(q, kv, kv, causal=True, window_left=127, learnable_sink=sink,
                                              compressed_kv=c, compress_ratio=4)
    return o * 2, lse


def fused_inputs():
    q, kv, _, g = attention_inputs(2, 200, 200, 128, 1, 512, torch.bfloat16, kv_shared=True)
    c = torch.randn(2, 50, 1, 512, generator=g).to(device="cuda", dtype=torch.bfloat16)
    return q, kv, c, torch.randn(128, generator=g).cuda()


@pytest.mark.stage_e
@pytest.mark.parametrize("arch", gpu_arch_params())
def test_fused_torch_compile_fullgraph_equals_eager(arch):
    args = fused_inputs()
    eager = fused_branch(*args)
    compiled = torch.compile(fused_branch, fullgraph=True)(*args)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.stage_e
@pytest.mark.parametrize("arch", gpu_arch_params())
def test_fused_cuda_graph_replay_equals_eager(arch):
    args = fused_inputs()
    assert_graph_replay_is_eager(lambda: fused_branch(*args))


def test_fake_fused_backward_takes_the_frame_and_offsets():
    """f_fused_backward's schema carries the queries' frame (seqused_k, positions, kv_start) and a
    variable-length batch's offsets (index mode's form of the layer): its fake gives each gradient
    its input's shape (packed q [total_q, heads, d], lse [heads, total_q]), so torch.compile traces
    the backward of such a call."""
    q, kv, c = meta(10, 64, 512), meta(30, 1, 512), meta(7, 1, 512)
    lse = torch.empty(64, 10, dtype=torch.float32, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    pos = torch.empty(10, dtype=torch.int32, device="meta")
    sink = torch.empty(64, dtype=torch.float32, device="meta")
    args = (q, kv, kv, q, lse, q)
    kwargs = dict(compressed_kv=c, compress_ratio=4, causal=True, window_left=127, learnable_sink=sink,
                  positions=pos, kv_start=5, cu_seqlens_q=cu, cu_seqlens_k=cu, cu_seqlens_compressed=cu,
                  max_seqlen_k=20)
    dq, dk, dv, dc, ds = torch.ops.dsv4_attention.f_fused_backward(*args, **kwargs)
    assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape and dc.shape == c.shape
    assert ds.shape == (64,) and ds.dtype == torch.float32
    torch.library.opcheck(torch.ops.dsv4_attention.f_fused_backward, args, kwargs,
                          test_utils=("test_schema", "test_faketensor"))
