"""Drafters beside the target in the model runner (speculative decoding, `draft_model` and
`eagle3`): models that propose each sequence's next tokens greedily, on the device.

A draft model is a smaller model with the target's vocabulary. Its KV pool has as many blocks
as the target's and is indexed by the target's block tables: every step, the draft model runs
over the step's own tokens (`before_step`), so it holds KV for exactly the positions the
target computed, cached prefix blocks included, and one block manager serves both. After a
step whose sequences draft next (`num_lookahead_tokens`), it takes each sampling sequence's
accepted tokens from the step's samples on the device, and proposes k tokens from its newest
one in k passes of one token a sequence (`after_sampling`). Those passes write KV at the
positions the drafts will take, which the scheduler reserved; the verification step's own
pass writes them again with the same tokens. An EAGLE-3 head does the same on the target's
hidden states (`Eagle3Runner`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.config import EngineConfig, ModelConfig, SpeculativeConfig
from liteinfer.engine.runner_output import (
    DraftPlan,
    HeadCatchUp,
    ProposalPlan,
    ProposedDrafts,
)
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for
from liteinfer.loader import ModelSource, load_model_source
from liteinfer.models.eagle3 import NUM_AUX_LAYERS, Eagle3LlamaForCausalLM, default_aux_layers
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.utils import to_device


def load_draft_source(spec: SpeculativeConfig, target: ModelConfig, target_load_format: str,
                      max_model_len: int, config: EngineConfig
                      ) -> tuple[ModelConfig, ModelSource]:
    """The draft model's config and source; a ValueError for a draft that cannot serve the
    target. A target with dummy weights gets a dummy draft (benchmarks)."""
    source = load_model_source(spec.model, "dummy" if target_load_format == "dummy" else "auto")
    draft = ModelConfig.from_hf(source.hf_config)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} "
                         f"tokens) differs from the target's ({target.vocab_size}); a draft "
                         f"model must share the target's tokenizer")
    try:
        draft.check_max_model_len(max_model_len)
    except ValueError as e:
        raise ValueError(f"speculative_config: the draft model cannot serve max_model_len="
                         f"{max_model_len}: {e}") from None
    for what, n in (("attention heads", draft.num_attention_heads),
                    ("KV heads", draft.num_key_value_heads)):
        if n % config.tensor_parallel_size:
            raise ValueError(f"speculative_config: the draft model's {n} {what} do not split "
                             f"over tensor_parallel_size={config.tensor_parallel_size}")
    return draft, source


def eagle3_settings(head_config: dict[str, Any], target: ModelConfig
                    ) -> tuple[int, tuple[int, ...]]:
    """An EAGLE-3 head's draft vocabulary size and the target layers it reads (its config's
    `eagle_aux_hidden_state_layer_ids`, else vLLM's default); a ValueError where they do not
    fit the target."""
    layers = tuple(head_config.get("eagle_aux_hidden_state_layer_ids")
                   or default_aux_layers(target.num_hidden_layers))
    if len(layers) != NUM_AUX_LAYERS or not all(
            0 <= i < target.num_hidden_layers for i in layers):
        raise ValueError(f"speculative_config: an EAGLE-3 head reads {NUM_AUX_LAYERS} of the "
                         f"target's {target.num_hidden_layers} layers, got {list(layers)}")
    if head_config["hidden_size"] != target.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE-3 head's hidden size "
                         f"{head_config['hidden_size']} is not the target's "
                         f"{target.hidden_size}")
    return head_config.get("draft_vocab_size") or head_config["vocab_size"], layers


class DraftModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor,
                 sampled_tokens: torch.Tensor, config: EngineConfig, table_width: int,
                 device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = config.block_size
        self.table_width = table_width
        self.device = device
        cfg = model.config
        tp = config.tensor_parallel_size
        num_kv_heads = cfg.num_key_value_heads // tp
        sms = num_sms(device)
        workspace = None
        if config.attention_backend == "triton":
            workspace = DecodeWorkspace.allocate(
                config.max_num_seqs, cfg.num_attention_heads // tp, cfg.head_dim,
                max_splits_for(1, num_kv_heads, sms), device)
        self.step_model = StepModel(model, 0, num_kv_heads, cfg.head_dim, sms, workspace, device)
        # Pending tokens are read where the target's steps read them.
        self.step_model.sampled_tokens = sampled_tokens

    @torch.inference_mode()
    def before_step(self, batch: StepBatch) -> DraftPlan | None:
        """Runs the draft model over the step's tokens (launched before the step samples: its
        pending tokens are read from the step before's samples), and plans the proposals
        after it if it asks for some."""
        ids, positions, meta, _, _ = self.step_model.prepare(batch, self.block_size,
                                                             self.table_width)
        self.model(ids, positions, meta)
        proposals = self._plan(batch)
        return None if proposals is None else DraftPlan(proposals)

    def _plan(self, batch: StepBatch) -> ProposalPlan | None:
        k = batch.num_lookahead_tokens
        if not k:
            return None
        max_drafts = max((batch.num_drafts(i) for i in range(len(batch.seqs))), default=0)
        seq_indices, rows, drafts, base, tables = [], [], [], [], []
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if not batch.samples(i):
                continue
            d = batch.num_drafts(i)
            first_row, row = row, row + 1 + d
            end = seq.num_computed_tokens + n  # tokens once the step has run
            if len(seq.block_table) * self.block_size < end + k:
                continue  # no room reserved for the proposals' KV
            seq_indices.append(i)
            rows.append([first_row + min(j, d) for j in range(max_drafts + 1)])
            drafts.append((batch.draft_token_ids[i] if d else []) + [-1] * (max_drafts - d))
            base.append(end - d)
            table = np.zeros(self.table_width, dtype=np.int64)
            table[:len(seq.block_table)] = seq.block_table
            tables.append(table)
        if not seq_indices:
            return None
        def as_tensor(data, dtype):
            return to_device(np.array(data, dtype=np.int64), dtype, self.device)
        return ProposalPlan(k, seq_indices, as_tensor(rows, torch.int64),
                            as_tensor(drafts, torch.int64).view(len(seq_indices), max_drafts),
                            as_tensor(base, torch.int64), as_tensor(tables, torch.int32))

    @staticmethod
    def _accepted(plan: ProposalPlan, sampled: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """Per proposing sequence, how many of its drafts its samples agree with (the scheduler
        keeps as many: scheduler._update_verified), and its samples."""
        samples = sampled[plan.sample_rows]
        num_drafts = plan.drafts.shape[1]
        agree = (samples[:, :num_drafts] == plan.drafts).to(torch.int64)
        return agree.cumprod(dim=1).sum(dim=1), samples

    @torch.inference_mode()
    def after_sampling(self, plan: DraftPlan, sampled: torch.Tensor) -> ProposedDrafts | None:
        """Greedy drafts after each planned sequence's accepted tokens and the sample after
        them. `sampled`: the step's sampled tokens, on the device."""
        p = plan.proposals
        accepted, samples = self._accepted(p, sampled)
        ids = samples.gather(1, accepted[:, None])[:, 0]
        positions = p.base + accepted
        proposed = []
        for _ in range(p.num_tokens):
            hidden = self.model(ids, positions, self._decode_metadata(positions, p))
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
            proposed.append(ids)
            positions = positions + 1
        return ProposedDrafts(torch.stack(proposed, dim=1), p.seq_indices)

    def _decode_metadata(self, positions: torch.Tensor, plan: ProposalPlan) -> AttentionMetadata:
        """One token a sequence at `positions` (on the device), in its own reserved blocks."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        blocks = plan.block_tables[rows, positions // self.block_size].to(torch.int64)
        context_lens = (positions + 1).to(torch.int32)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            context_lens=context_lens, block_tables=plan.block_tables, cu_seqlens_q=None)
        sm = self.step_model
        if sm.decode_workspace is not None:
            sm.set_split_k(meta, positions.shape[0], may_split=True)
        else:  # the torch backends read the lengths on the host
            meta.query_lens_host = [1] * positions.shape[0]
            meta.context_lens_host = context_lens.tolist()
        return meta


class Eagle3Runner(DraftModelRunner):
    """An EAGLE-3 head (models/eagle3.py) as the drafter. At position p it reads the token at
    p + 1, so its pass over a step's tokens waits for the step's samples: once the step is
    sampled it catches up (with the target's hidden states of the step) and its output at each
    proposing sequence's last accepted position gives the first draft; k - 1 passes of one
    token a sequence, on its own hidden states, give the others."""

    def __init__(self, model: Eagle3LlamaForCausalLM, target: LlamaForCausalLM,
                 kv_cache: torch.Tensor, sampled_tokens: torch.Tensor, config: EngineConfig,
                 table_width: int, device: torch.device):
        super().__init__(model, kv_cache, sampled_tokens, config, table_width, device)
        self.target = target

    @torch.inference_mode()
    def before_step(self, batch: StepBatch) -> DraftPlan:
        _, positions, meta, sample_rows, _ = self.step_model.prepare(batch, self.block_size,
                                                                     self.table_width)
        next_ids = np.zeros(sum(batch.num_tokens), dtype=np.int64)
        drafts = batch.draft_token_ids or [[]] * len(batch.seqs)
        start = 0
        for seq, n, d in zip(batch.seqs, batch.num_tokens, drafts):
            c = seq.num_computed_tokens
            after = seq.token_ids[c + 1:c + 1 + n]
            after += d[:n - len(after)]  # a verifying sequence's tokens go on with its drafts
            next_ids[start:start + len(after)] = after
            start += n
        catch_up = HeadCatchUp(to_device(next_ids, torch.int64, self.device), positions, meta,
                               sample_rows)
        return DraftPlan(self._plan(batch), catch_up)

    @torch.inference_mode()
    def after_sampling(self, plan: DraftPlan, sampled: torch.Tensor) -> ProposedDrafts | None:
        """`self.target.aux_hidden_states`: the target's, from this step's forward pass (no
        other pass of the target runs between a step's launch and its sampling)."""
        c = plan.catch_up
        next_ids = c.next_ids.index_put((c.sample_rows,), sampled)
        head = self.model
        hidden = head(next_ids, c.positions, c.meta, self.target.aux_hidden_states)
        p = plan.proposals
        if p is None:
            return None
        accepted, _ = self._accepted(p, sampled)
        hidden = hidden[c.sample_rows[p.sample_rows.gather(1, accepted[:, None])[:, 0]]]
        ids = head.to_target_ids(head.compute_logits(hidden).argmax(dim=-1))
        proposed = [ids]
        positions = p.base + accepted
        for _ in range(p.num_tokens - 1):
            hidden = head(ids, positions, self._decode_metadata(positions, p), hidden)
            ids = head.to_target_ids(head.compute_logits(hidden).argmax(dim=-1))
            proposed.append(ids)
            positions = positions + 1
        return ProposedDrafts(torch.stack(proposed, dim=1), p.seq_indices)
