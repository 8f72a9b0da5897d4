"""Packed documents (``cu_seqlens``): a packed row equals its documents run one by one and concatenated,
forward (output, block indices, compressed tokens) and backward (all gradients), on every backend;
lengths include documents shorter than ``l`` and than ``l_sel``. Fixed seeds; the Triton kernels run under
``TRITON_INTERPRET=1`` on CPU (float32) and on a GPU in bf16 when one is present.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from nsa import ops
from nsa.ops import NSAParams, varlen
from tests.conftest import Job, run_job

HAS_CUDA = torch.cuda.is_available()
NSA = NSAParams(l=8, d=4, l_sel=16, n_sel=2, w=12)
LENGTHS = [5, 40, 17, 64, 3, 90, 1, 33]  # < l, < l_sel, exact multiples, one token


def _inputs(lengths: list[int], seed: int, dtype: torch.dtype, device: str, HQ: int = 4, H: int = 2, D: int = 8,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    T = sum(lengths)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(True)

    x = {"q": rnd(1, T, HQ, D), "k": rnd(1, T, H, D), "v": rnd(1, T, H, D), "ks": rnd(1, T, H, D),
         "vs": rnd(1, T, H, D), "kw": rnd(1, T, H, D), "vw": rnd(1, T, H, D),
         "g": torch.rand(1, T, HQ, 3, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(True)}
    return cu, x


def _run(x: dict[str, torch.Tensor], backend: str, cu: torch.Tensor | None, sl: slice = slice(None),
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def part(t: torch.Tensor) -> torch.Tensor:
        return t[:, sl]

    k_cmp = ops.compress_avg(part(x["k"]), NSA, backend=backend, cu_seqlens=cu)
    v_cmp = ops.compress_avg(part(x["v"]), NSA, backend=backend, cu_seqlens=cu)
    o, idx = ops.nsa_attention(part(x["q"]), k_cmp, v_cmp, *(part(x[n]) for n in ("ks", "vs", "kw", "vw", "g")),
                               NSA, backend=backend, cu_seqlens=cu, return_block_idx=True)
    return o, idx, k_cmp


def _check(backend: str, lengths: list[int], seed: int, dtype: torch.dtype, device: str, tol: float) -> None:
    """Packed on ``backend`` vs each document alone on the reference (float64)."""
    cu, x = _inputs(lengths, seed, dtype, device)
    o, idx, k_cmp = _run(x, backend, cu)
    ref64 = {n: t.detach().double().cpu().requires_grad_(True) for n, t in x.items()}
    bounds = cu.tolist()
    parts = [_run(ref64, "reference", None, slice(a, b)) for a, b in itertools.pairwise(bounds)]
    o_ref = torch.cat([p[0] for p in parts], 1)
    assert torch.equal(idx.cpu().long(), torch.cat([p[1] for p in parts], 1).long())
    assert torch.allclose(k_cmp.double().cpu(), torch.cat([p[2] for p in parts], 1), atol=tol, rtol=0)
    scale = float(o_ref.detach().abs().max())
    assert float((o.detach().double().cpu() - o_ref.detach()).abs().max()) <= tol * scale
    up = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    grads = torch.autograd.grad((o.double() * up.to(device)).sum(), list(x.values()))
    grads_ref = torch.autograd.grad((o_ref * up).sum(), list(ref64.values()))
    for name, g, gr in zip(x, grads, grads_ref, strict=True):
        err = float((g.double().cpu() - gr).abs().max()) / max(float(gr.abs().max()), 1e-12)
        assert err <= tol, (name, err)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_packed_equals_documents_one_by_one(backend: str) -> None:
    """Seed 11: eight documents of 1 to 90 tokens, float64, forward and every gradient."""
    _check(backend, LENGTHS, 11, torch.float64, "cpu", 1e-10)


def test_single_document_is_the_plain_call() -> None:
    """Seed 3: cu_seqlens = [0, T] gives exactly the unpacked call."""
    cu, x = _inputs([70], 3, torch.float64, "cpu")
    o, idx, _ = _run(x, "torch", cu)
    o0, idx0, _ = _run(x, "torch", None)
    assert torch.equal(idx, idx0) and torch.allclose(o, o0, atol=1e-12, rtol=0)


INTERPRETER_JOB = Job("from nsa import ops\nfrom tests.test_varlen import _check, LENGTHS\n"
                      "ops.reset_fallback_counts()\n"
                      "_check('triton', LENGTHS[:5], 5, torch.float32, 'cpu', 1e-4)\n"
                      "assert ops.fallback_counts() == {}, ops.fallback_counts()\n")


@pytest.mark.skipif(HAS_CUDA, reason="interpreter cases run where there is no GPU")
@pytest.mark.beside(INTERPRETER_JOB)
def test_triton_packed_in_the_interpreter() -> None:
    """Seed 5, float32 under TRITON_INTERPRET=1: the Triton kernels on packed documents, no fallback."""
    run_job(INTERPRETER_JOB)


@pytest.mark.gpu
def test_triton_packed_on_gpu() -> None:
    """Seed 7, bf16 on the GPU: documents of 1 to 700 tokens packed into one row."""
    ops.reset_fallback_counts()
    _check("triton", [700, 3, 129, 64, 1, 250, 31], 7, torch.bfloat16, "cuda", 3e-2)
    assert ops.fallback_counts() == {}


def test_select_blocks_is_local_to_each_document() -> None:
    """Seed 2: block indices count from each document's start; the first block of every document is chosen."""
    cu, x = _inputs([40, 50], 2, torch.float64, "cpu")
    k_cmp = ops.compress_avg(x["k"], NSA, cu_seqlens=cu)
    idx = ops.select_blocks(x["q"], k_cmp, NSA, cu_seqlens=cu)
    second = ops.select_blocks(x["q"][:, 40:], ops.compress_avg(x["k"][:, 40:], NSA), NSA)
    assert torch.equal(idx[:, 40:], second)
    assert int(idx[0, 40:, :, 0].min()) == 0 and int(idx[0, 40:].max()) <= (50 - 1) // 16


def test_positions_restart_at_each_document() -> None:
    cu = torch.tensor([0, 3, 4, 9])
    assert varlen.positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


def test_positions_traced_by_torch_compile_agree_with_eager() -> None:
    """Seed 5: the compiled form (a reduction, not ``searchsorted``) on random document lengths, one graph for
    every count of documents."""
    g = torch.Generator().manual_seed(5)
    traced = torch.compile(varlen.positions, backend="eager", fullgraph=True, dynamic=True)
    for n in (1, 3, 7):
        lengths = torch.randint(1, 40, (n,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
        total = int(cu[-1])
        assert torch.equal(traced(cu, total), varlen.positions(cu, total))
        assert varlen.positions(cu, total)[cu[:-1].long()].eq(0).all()


def test_host_offsets_follow_in_place_writes() -> None:
    """The host copy of ``cu_seqlens`` is reused across calls but never after the tensor changed."""
    cu = torch.tensor([0, 3, 9])
    assert varlen.host_offsets(cu, 9) == [0, 3, 9]
    cu[1] = 5
    assert varlen.host_offsets(cu, 9) == [0, 5, 9]


def test_bucket_plan_pads_at_most_to_the_next_power_of_two() -> None:
    cu = [0, 5, 205, 305, 1305]
    buckets = varlen.plan(cu, torch.device("cpu"))
    assert sorted(d for b in buckets for d in b.docs) == [0, 1, 2, 3]
    for b in buckets:
        assert b.src.numel() == b.dst.numel() == sum(cu[n + 1] - cu[n] for n in b.docs)
        assert b.length == max(cu[n + 1] - cu[n] for n in b.docs)
    assert [len(b.docs) for b in varlen.plan(cu, torch.device("cpu"), alone_from=0)] == [1, 1, 1, 1]
    # the documents of 200 rows or more alone (unpadded), the others (5 and 100 rows) by length
    parted = varlen.plan(cu, torch.device("cpu"), alone_from=200)
    assert sorted((b.docs, b.length) for b in parted) == [((0,), 5), ((1,), 200), ((2,), 100), ((3,), 1000)]
    assert sorted(b.docs for b in varlen.plan([0, 5, 9, 300], torch.device("cpu"), alone_from=200)) == [(0, 1), (2,)]


@pytest.mark.parametrize(("cu", "batch", "needle"), [
    ([0, 5, 9], 1, "ends at 9"),
    ([0, 5, 5, 10], 1, "increase strictly"),
    ([1, 10], 1, "start at 0"),
    ([0, 10], 2, "batch-1"),
])
def test_bad_cu_seqlens_is_one_clear_error(cu: list[int], batch: int, needle: str) -> None:
    x = torch.zeros(batch, 10, 2, 8)
    with pytest.raises(ValueError, match=needle):
        ops.compress_avg(x, NSA, cu_seqlens=torch.tensor(cu))


# --- the model -------------------------------------------------------------------------------------


def _tiny_model(attention: str) -> torch.nn.Module:
    from nsa.config import RunConfig, find_config, read_yaml
    from nsa.model import build_model

    cfg = RunConfig.model_validate(read_yaml(find_config("tiny")))
    cfg.model.attention = attention  # type: ignore[assignment]
    cfg.model.n_layers = 2
    cfg.runtime.attn_backend = "torch"
    torch.manual_seed(0)
    return build_model(cfg).eval()


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_model_on_packed_rows_equals_each_document_alone(attention: str) -> None:
    """Seed 4: two rows of 64 tokens with separators (id 0) at 9, 30, 31 and 100; every document's logits
    equal the model's logits of that document alone (positions from 0, nothing seen across a boundary)."""
    from nsa.model.documents import from_separators

    model = _tiny_model(attention)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 200, (2, 64), generator=gen)
    ids.view(-1)[[9, 30, 31, 100]] = 0
    cu = from_separators(ids, 0)
    assert cu.tolist() == [0, 10, 31, 32, 64, 101, 128]
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits.reshape(128, -1)
        for a, b in zip(cu.tolist(), cu.tolist()[1:], strict=False):
            alone = model(ids.reshape(1, -1)[:, a:b]).logits[0]
            assert torch.allclose(packed[a:b], alone, atol=2e-5, rtol=0), (a, b)
        plain = model(ids).logits.reshape(128, -1)
    assert not torch.allclose(packed[10:31], plain[10:31], atol=1e-3)  # without the mask they differ


def test_selection_report_over_packed_documents_is_each_documents_own() -> None:
    """Seed 8: the selection probe of a masked batch (two rows of 128: documents of 50, 78 and 128 tokens)
    probes each document on its own: per layer, the length-weighted mean of each document's report alone.
    Before, the packed path recorded no probe (the trainer and ``nsa eval`` read a masked run across its
    documents instead)."""
    from nsa.model.documents import from_separators
    from nsa.model.selection import merge_reports

    model = _tiny_model("nsa")
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(1, 200, (2, 128), generator=gen)
    ids[0, 49] = 0
    cu = from_separators(ids, 0)
    assert cu.tolist() == [0, 50, 128, 256]
    packed = model.selection_report(ids, 16, cu_seqlens=cu)
    alone = [model.selection_report(ids.reshape(1, -1)[:, a:b], 16) for a, b in ((0, 50), (50, 128), (128, 256))]
    lengths = (50, 78, 128)
    assert len(packed) == 2
    for layer, got in enumerate(packed):
        want = merge_reports([({k: v for k, v in rep[layer].items() if k != "layer"}, n)
                              for rep, n in zip(alone, lengths, strict=True)])
        assert got["layer"] == layer and 0 < got["recall"] <= 1
        for key in ("recall", "recall_best", "recall_forced", "cmp_entropy", "kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert got["gates"] == pytest.approx(want["gates"], rel=1e-5)
    whole = model.selection_report(ids, 16)  # without the mask: another reading
    assert whole[0]["recall"] != pytest.approx(packed[0]["recall"], rel=1e-6)


def test_model_with_documents_compiles_and_matches_eager() -> None:
    """Seed 6: torch.compile of the NSA model with packed documents (the attention runs eagerly between
    compiled pieces): same loss and gradients as eager, and no recompilation on a new document layout."""
    model = _tiny_model("nsa").train()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 200, (2, 65), generator=gen)
    ids[0, 20] = ids[1, 7] = 0
    x, y = ids[:, :-1], ids[:, 1:]
    from nsa.model.documents import from_separators

    cu = from_separators(x, 0)
    loss_e = model(x, labels=y, cu_seqlens=cu).loss
    grads_e = torch.autograd.grad(loss_e, list(model.parameters()), allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    loss_c = compiled(x, labels=y, cu_seqlens=cu).loss
    grads_c = torch.autograd.grad(loss_c, list(model.parameters()), allow_unused=True)
    assert abs(float(loss_c.detach()) - float(loss_e.detach())) <= 1e-5 * abs(float(loss_e.detach()))
    for ge, gc in zip(grads_e, grads_c, strict=True):
        assert (ge is None) == (gc is None)
        if ge is not None:
            assert torch.allclose(ge, gc, atol=1e-5, rtol=1e-4)
    x2 = x.clone()
    x2[0, 40] = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(x2, labels=y, cu_seqlens=from_separators(x2, 0))


def test_model_rejects_boundaries_that_miss_a_row_start() -> None:
    model = _tiny_model("nsa")
    with pytest.raises(ValueError, match="row start"):
        model(torch.ones(2, 16, dtype=torch.long), cu_seqlens=torch.tensor([0, 10, 32], dtype=torch.int32))


def test_training_with_document_mask(tmp_path: Path) -> None:
    """A short run with ``data.document_mask`` trains (finite, falling loss), records the setting, and its
    evaluations read the selection of its documents (each probed on its own)."""
    from nsa.train.trainer import Trainer
    from tests.conftest import csv_rows, quiet, resolve

    out = tmp_path / "run"
    result = Trainer(resolve(out, 6, data__document_mask=True, eval__every=3, eval__selection_queries=16,
                             train__seq_len=256), reporter=quiet()).fit()
    assert result.status == "completed" and result.steps_done == 6
    assert "document_mask: true" in (out / "config.yaml").read_text()
    val = csv_rows(out / "val.csv")
    assert [int(r["step"]) for r in val] == [3, 6] and all(0 < float(r["sel_recall_mean"]) <= 1 for r in val)
