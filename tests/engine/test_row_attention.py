"""bfloat16 on CPU: every prompt token is a query row of the native attention kernel (no torch
attention over prefill spans). Each row must see exactly its own sequence's keys up to its own
position, in steps that mix decodes, fresh prompt chunks and chunks after a cached prefix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex import SamplingParams
from loraplex.engine import model as model_module
from tests.factories import make_llm

PREFIX = "the old king of the river city tells a story of light and dark " * 3


def reference_rows(q, kv_cache, batch, scale, sequences, page_size) -> torch.Tensor:
    """Each row's attention over its sequence's keys up to its own position, found from the
    sequences themselves (not from the batch's tables), gathered and in float32."""
    out = []
    for row, position in enumerate(batch.positions.tolist()[: batch.num_row_queries]):
        own_page = int(batch.slot_pages[row])  # the page this row's token is written to
        page = position // page_size
        (seq,) = [s for s in sequences if s.block_table[page : page + 1] == [own_page]]
        pages = torch.tensor(seq.block_table[: page + 1])
        kv = kv_cache[pages].flatten(0, 1)[: position + 1].float()
        keys, values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
        query = q[row].float().unsqueeze(1)  # [heads, 1, dim]
        attended = F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)
        out.append(attended.squeeze(1))
    return torch.stack(out)


def test_prompt_tokens_attend_as_rows_of_the_kernel_in_bfloat16(tiny_llama, monkeypatch):
    llm = make_llm(
        tiny_llama, dtype="bfloat16", max_num_batched_tokens=24, page_size=4, max_num_seqs=4
    )
    settings = llm.engine.runner.settings
    assert settings.attention_kernel is not None and settings.prefill_in_kernel
    # each layer's attention from Python, where this test sees its rows (in one native call the
    # layers give the same bits: test_fused_layers.py)
    llm.engine.runner.model.fuse_layers = False
    seen = {"rows": 0, "prefill_rows": 0, "after_cache": 0, "mixed": 0}
    attend = model_module.paged_attention

    def checked(q, kv_cache, batch, scale):
        out = attend(q, kv_cache, batch, scale)
        assert not batch.prefills  # no span left to torch's attention
        assert batch.num_row_queries == q.shape[0]
        running = llm.engine.scheduler.running
        want = reference_rows(q, kv_cache, batch, scale, running, page_size=4)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
        positions = batch.positions.tolist()
        seen["rows"] += batch.num_row_queries
        seen["prefill_rows"] += batch.num_row_queries - batch.num_decodes
        # a prompt chunk whose first row sees tokens computed in an earlier step or request
        seen["after_cache"] += any(
            p > 0 and row >= batch.num_decodes and (row == 0 or positions[row - 1] != p - 1)
            for row, p in enumerate(positions)
        )
        seen["mixed"] += 0 < batch.num_decodes < batch.num_row_queries
        return out

    monkeypatch.setattr(model_module, "paged_attention", checked)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([PREFIX + "hello world"], greedy)  # the prefix's pages cached
    # a short prompt decodes while the others are still in their prompts' chunks
    prompts = ["cat", PREFIX + "dog sleeps", "green mountain 42 " * 12]
    results = llm.generate(prompts, greedy)
    assert all(len(r.outputs[0].token_ids) == 6 for r in results)
    assert seen["prefill_rows"] > 0 and seen["after_cache"] > 0 and seen["mixed"] > 0, seen
