"""--eod-mask-loss, --reset-position-ids and --reset-attention-mask: the batch fields against Megatron's loop
(get_ltor_masks_and_position_ids, written out here), the model on a packed sample against each document alone, the
trainer's datasets, and a pp = 2 pipeline (later stages get the same position ids and mask; bf16 stages with
--fp32-residual-connection pass fp32 boundary tensors, checked by the P2P layer) against pp = 1, bit for bit."""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import timedelta

import numpy as np
import pytest
import torch
from data_assets import tool
from model_configs import pipeline_config, tiny_config

from megatron.arguments import parse_run_config
from megatron.config.documents import DocumentMaskConfig
from megatron.config.errors import ConfigError
from megatron.data.blended_dataset import build_gpt_datasets
from megatron.data.document_masks import (
    DocumentMaskedDataset,
    apply_document_masks,
    document_attention_mask,
    model_inputs,
)
from megatron.data.mock_data import MockGPTDataset
from megatron.microbatches import load_microbatch, microbatch_loss
from megatron.model import build_gpt_model
from megatron.parallel.context import ParallelContext
from megatron.pipeline import ScheduleConfig, build_gpt_pipeline
from megatron.training import pretrain
from megatron.training_setup import document_masked
from zb_pipeline.testing import run_multiprocess

ALL = DocumentMaskConfig(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
EOD = 0


def _megatron_reference(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's loop over each sample's EOD positions: (loss_mask, position_ids, attention_mask True = masked)."""
    b, s = tokens.shape
    attention = torch.tril(torch.ones(b, s, s))
    loss_mask = torch.ones(b, s)
    loss_mask[tokens == eod] = 0.0
    positions = torch.arange(s).repeat(b, 1)
    for i in range(b):
        prev = 0
        for j in (tokens[i] == eod).nonzero().flatten().tolist():
            attention[i, j + 1 :, : j + 1] = 0
            positions[i, j + 1 :] -= j + 1 - prev
            prev = j + 1
    return loss_mask, positions, (attention < 0.5).unsqueeze(1)


def test_fields_match_megatrons_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (16, 12), generator=gen)  # EOD (0) often: runs of EODs, at either end
    tokens[0, -1] = tokens[1, 0] = EOD
    samples = [apply_document_masks({"tokens": t, "loss_mask": torch.ones(12)}, EOD, ALL) for t in tokens]
    loss_mask, positions, mask = _megatron_reference(tokens, EOD)
    assert torch.equal(torch.stack([s["loss_mask"] for s in samples]), loss_mask)
    assert torch.equal(torch.stack([s["position_ids"] for s in samples]), positions)
    assert torch.equal(document_attention_mask(torch.stack([s["document_ids"] for s in samples])), mask)
    only_loss = apply_document_masks({"tokens": tokens[0], "loss_mask": torch.ones(12)}, EOD, DocumentMaskConfig(True))
    assert set(only_loss) == {"tokens", "loss_mask"}  # without the reset flags: implicit positions and causal mask


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_packed_documents_are_seen_like_separate_samples(position_embedding_type: str) -> None:
    cfg = tiny_config(position_embedding_type=position_embedding_type)
    model = build_gpt_model(cfg, seed=4)
    gen = torch.Generator().manual_seed(1)
    first, second = torch.randint(1, 100, (6,), generator=gen), torch.randint(1, 100, (9,), generator=gen)
    packed = torch.cat([first, torch.tensor([EOD]), second])[None]  # [1, 16]: two documents
    alone = torch.cat([second, torch.randint(1, 100, (7,), generator=gen)])[None]  # the second one first
    fields = apply_document_masks({"tokens": packed[0], "loss_mask": torch.ones(16)}, EOD, ALL)
    batch = {k: v[None] for k, v in fields.items()}
    with torch.no_grad():
        reset = model(packed, **model_inputs(batch))[7:, 0]  # logits [s, b, V]: the second document's rows
        plain = model(packed)[7:, 0]
        ref = model(alone)[:9, 0]
    torch.testing.assert_close(reset, ref, rtol=1e-5, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3  # without the flags the first document leaks in
    assert batch["loss_mask"][0, 6] == 0 and batch["loss_mask"].sum() == 15  # no loss predicting after the EOD


def test_trainer_datasets_carry_the_fields() -> None:
    common = ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--num-layers", "2"]
    common += ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64"]
    argv = [*common, "--mock-data"]
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "7"]  # EOD = 7 of a vocabulary of 8
    run = parse_run_config([*argv, *null, "--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"])
    assert run.documents == ALL and run.model_flag_notes == ()
    assert run.model.vocab_size == 8 and run.data.vocab_size == 7  # mock tokens are drawn over ids 0..7, EOD included
    mock = MockGPTDataset(seed=1, seq_length=64, vocab_size=run.model.vocab_size, num_samples=4)
    dataset = document_masked(run, mock)
    assert isinstance(dataset, DocumentMaskedDataset) and dataset.eod == 7
    batch = load_microbatch(dataset, [0, 1], torch.device("cpu"))
    eods = batch["tokens"] == 7
    assert eods.any() and torch.equal(batch["loss_mask"] == 0, eods)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
    model = build_gpt_model(tiny_config(vocab_size=8, seq_length=64), seed=2)
    per_token = model(batch["tokens"], labels=batch["labels"], **model_inputs(batch))
    expected = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    torch.testing.assert_close(microbatch_loss(model, batch), expected, rtol=0, atol=0)
    plain = parse_run_config([*argv, *null])
    assert document_masked(plain, dataset.dataset) is dataset.dataset  # no flag: the dataset untouched
    mock_only = parse_run_config([*argv, "--eod-mask-loss"])
    assert any("no end-of-document token" in w for w in mock_only.ignored_flag_warnings())
    no_files = parse_run_config([*argv, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "9", "--eod-mask-loss"])
    assert any("no end-of-document token" in w for w in no_files.ignored_flag_warnings())
    with pytest.raises(ConfigError, match="end-of-document id; pass --tokenizer-type and its files"):
        parse_run_config([*common, "--data-path", "x", "--vocab-size", "9", "--reset-position-ids"])


def test_null_tokenizer_data_with_appended_eods_trains_and_masks_them(tmp_path) -> None:
    """Megatron's NullTokenizer: ``--vocab-size N`` is ids 0..N-1 plus the EOD id N, a vocabulary of N + 1, so a
    dataset preprocessed with ``--append-eod`` fits the model and ``--eod-mask-loss`` finds its EODs."""
    preprocess_data = tool("preprocess_data")
    docs = [" ".join(str((7 * d + 3 * i) % 10) for i in range(2 + d % 5)) for d in range(30)]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    prefix = str(tmp_path / "ids")
    argv = ["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", prefix, *null, "--append-eod", "--no-progress"]
    assert preprocess_data.main([*argv, "--workers", "1"]) == 0
    prefix += "_text_document"
    common = ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--num-layers", "1", "--hidden-size"]
    common += ["32", "--num-attention-heads", "4", "--seq-length", "16", "--split", "1,0,0", "--eval-iters", "0"]
    common += ["--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")]
    run = parse_run_config([*common, *null, "--eod-mask-loss", "--save", str(tmp_path / "ckpt")])
    assert (run.model.vocab_size, run.data.vocab_size, run.padded_vocab_size) == (11, 10, 128)
    summary = pretrain(run, stream=io.StringIO())
    assert len(summary.losses) == 2 and all(np.isfinite(summary.losses))
    train = build_gpt_datasets(prefix, split="1,0,0", seq_length=16, seed=1, num_samples=(4, 0, 0), vocab_size=11)[0]
    batch = load_microbatch(document_masked(run, train), [0, 1, 2, 3], torch.device("cpu"))
    eods = batch["tokens"] == 10
    assert eods.sum() >= 4 and torch.equal(batch["loss_mask"] == 0, eods)
    # --use-checkpoint-args brings the tokenizer with its --vocab-size back: the same 11-id model
    resumed = parse_run_config([*common, "--load", str(tmp_path / "ckpt"), "--use-checkpoint-args"])
    assert (resumed.data.tokenizer_type, resumed.model.vocab_size, resumed.data.vocab_size) == ("NullTokenizer", 11, 10)
    # no tokenizer: --vocab-size is the model's vocabulary as before, and the EOD id 10 does not fit it
    with pytest.raises(ConfigError, match="holds token id 10 but the tokenizer's vocab size is 10"):
        pretrain(parse_run_config([*common, "--vocab-size", "10"]), stream=io.StringIO())


M, B, S = 3, 2, 6


def _pp_config():  # RoPE: the later stages need the position ids too; bf16 stages pass an fp32 residual stream
    return dataclasses.replace(
        pipeline_config(4, tied=False), position_embedding_type="rope", fp32_residual_connection=True
    )


def _document_batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for k in range(M):
        t = torch.randint(0, 61, (B, S + 1), generator=torch.Generator().manual_seed(700 + k))
        t[0, 2] = t[1, 3 + k % 3] = EOD
        fields = [apply_document_masks({"tokens": r[:-1], "loss_mask": torch.ones(S)}, EOD, ALL) for r in t]
        batch = {key: torch.stack([f[key] for f in fields]) for key in fields[0]}
        out.append({**batch, "labels": t[:, 1:].contiguous()})
    return out


def _pipeline_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    cfg = ScheduleConfig(schedule="zb-h1", p2p_check=True)
    ctx = ParallelContext.initialize(pp=world_size, timeout=timedelta(seconds=30), chunks=1, placement="loop")
    out = {}
    for use_fields in (True, False):  # without them: RoPE's implicit [s, 1, 1, r] tables on both stages
        pipe = build_gpt_pipeline(
            ctx, _pp_config(), cfg, num_microbatches=M, micro_batch_size=B, seed=11, dtype=torch.bfloat16
        )
        batches = _document_batches()
        if not use_fields:
            batches = [{k: v for k, v in b.items() if k not in ("position_ids", "document_ids")} for b in batches]
        total = pipe.forward_backward(batches)
        grads = {}
        for stage in pipe.stages.values():
            for n, p in stage.named_parameters():
                grads[stage.global_name(n)] = p.grad.float().numpy().copy()
        out[use_fields] = {"total": total.item(), "grads": grads}
    return out


def _reference(use_fields: bool) -> tuple[float, dict[str, np.ndarray]]:
    model = build_gpt_model(_pp_config(), seed=11).to(torch.bfloat16)
    total = torch.zeros((), dtype=torch.float64)
    for batch in _document_batches():
        extra = model_inputs(batch) if use_fields else {}
        per_token = model(batch["tokens"], labels=batch["labels"], **extra)
        mask = batch["loss_mask"]
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        (loss / M).backward()
        total += loss.detach().double()
    return total.item(), {n: p.grad.float().numpy().copy() for n, p in model.named_parameters()}


def test_pipeline_stages_get_the_position_ids_and_mask() -> None:
    """zb-h1 on 2 ranks against the single model, bit for bit: with the fields (position ids and mask on every
    stage), and without them (RoPE's implicit positions 0..s-1 and the causal mask on every stage)."""
    results = run_multiprocess(_pipeline_rank, 2, args=(), timeout_s=120)
    refs = {use_fields: _reference(use_fields) for use_fields in (True, False)}
    assert abs(refs[False][0] - refs[True][0]) > 1e-4  # the fields change the loss
    for use_fields, (ref_total, ref) in refs.items():
        got0, got1 = results[0][use_fields], results[1][use_fields]
        assert got0["total"] == got1["total"] == ref_total, use_fields
        got = {**got0["grads"], **got1["grads"]}
        assert got.keys() == ref.keys()
        for name, g in got.items():
            assert np.array_equal(g, ref[name]), (use_fields, name)


def test_middle_pipeline_ranks_load_the_batches_the_fields_need() -> None:
    from types import SimpleNamespace

    from megatron.pipeline.trainer_hooks import _batches

    dataset = DocumentMaskedDataset(
        MockGPTDataset(seed=1, seq_length=8, vocab_size=8, num_samples=8), eod=7, config=ALL
    )
    middle = SimpleNamespace(holds_first_stage=False, holds_last_stage=False)
    ctx = SimpleNamespace(dp_rank=0, device=torch.device("cpu"))

    def batches(documents: DocumentMaskConfig) -> list[dict]:
        training = SimpleNamespace(micro_batch_size=2)
        run = SimpleNamespace(num_microbatches=2, dp_size=1, training=training, documents=documents)
        return _batches(SimpleNamespace(run=run, ctx=ctx, pipeline=middle), dataset, 0)

    loaded = batches(ALL)  # RoPE positions and the mask are read by every stage
    assert [set(b) >= {"position_ids", "document_ids"} for b in loaded] == [True, True]
    assert batches(DocumentMaskConfig(eod_mask_loss=True)) == [{}, {}]  # only the last stage reads the loss mask


def test_middle_pipeline_ranks_read_the_training_batches_the_fields_need() -> None:
    from types import SimpleNamespace

    from megatron.pipeline.trainer_hooks import _train_batches

    middle = SimpleNamespace(holds_first_stage=False, holds_last_stage=False)
    loaded = [{"position_ids": torch.arange(8)}, {"position_ids": torch.arange(8)}]
    loader = SimpleNamespace(batches=lambda it: loaded if it == 3 else None)

    def batches(documents: DocumentMaskConfig) -> list[dict]:
        run = SimpleNamespace(documents=documents, num_microbatches_at=lambda it: 2)
        return _train_batches(SimpleNamespace(run=run, pipeline=middle, train_loader=loader, iteration=3))

    assert batches(ALL) is loaded  # RoPE positions and the mask are read by every stage
    assert batches(DocumentMaskConfig(eod_mask_loss=True)) == [{}, {}]  # only the last stage reads the loss mask
