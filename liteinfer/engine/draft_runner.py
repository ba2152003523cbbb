"""A draft model beside the target (speculative decoding, `draft_model`): a smaller model with
the target's vocabulary that proposes each sequence's next tokens greedily, on the device.

Its KV pool has as many blocks as the target's and is indexed by the target's block tables:
every step, the draft model runs over the step's own tokens (`catch_up`), so it holds KV for
exactly the positions the target computed, cached prefix blocks included, and one block
manager serves both. After a step whose sequences draft next (`num_lookahead_tokens`), it
takes each sampling sequence's accepted tokens from the step's samples on the device, and
proposes k tokens from its newest one in k passes of one token a sequence (`propose`). Those
passes write KV at the positions the drafts will take, which the scheduler reserved; the
verification step's own catch-up writes them again with the same tokens."""
from __future__ import annotations

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.config import EngineConfig, ModelConfig, SpeculativeConfig
from liteinfer.engine.runner_output import DraftPlan, ProposedDrafts
from liteinfer.engine.scheduler import SchedulerOutput
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for
from liteinfer.loader import ModelSource, load_model_source
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
    def catch_up(self, batch: SchedulerOutput) -> DraftPlan | None:
        """Runs the draft model over the step's tokens (launched before the step samples: its
        pending tokens are read from the step before's samples), and plans the proposals
        after it if it asks for some."""
        ids, positions, meta, _, _ = self.step_model.prepare(batch, self.block_size,
                                                             self.table_width)
        self.model(ids, positions, meta)
        return self._plan(batch) if batch.num_lookahead_tokens else None

    def _plan(self, batch: SchedulerOutput) -> DraftPlan | None:
        k = batch.num_lookahead_tokens
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
        return DraftPlan(k, seq_indices, as_tensor(rows, torch.int64),
                         as_tensor(drafts, torch.int64).view(len(seq_indices), max_drafts),
                         as_tensor(base, torch.int64), as_tensor(tables, torch.int32))

    @torch.inference_mode()
    def propose(self, plan: DraftPlan, sampled: torch.Tensor) -> ProposedDrafts:
        """Greedy drafts after each planned sequence's accepted tokens. `sampled`: the step's
        sampled tokens, on the device. A sequence keeps the drafts its samples agree with and
        the sample after them, as the scheduler will (scheduler._update_verified)."""
        samples = sampled[plan.sample_rows]
        num_drafts = plan.drafts.shape[1]
        agree = (samples[:, :num_drafts] == plan.drafts).to(torch.int64)
        accepted = agree.cumprod(dim=1).sum(dim=1)
        ids = samples.gather(1, accepted[:, None])[:, 0]
        positions = plan.base + accepted
        proposed = []
        for _ in range(plan.num_tokens):
            hidden = self.model(ids, positions, self._decode_metadata(positions, plan))
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
            proposed.append(ids)
            positions = positions + 1
        return ProposedDrafts(torch.stack(proposed, dim=1), plan.seq_indices)

    def _decode_metadata(self, positions: torch.Tensor, plan: DraftPlan) -> AttentionMetadata:
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
