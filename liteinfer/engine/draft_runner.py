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

Where the target's steps are captured, so are the draft model's: its pass over a step's
tokens has the target step's shape and replays the same kinds of graphs (decode steps
without the LM head, prompt steps), and its proposal passes replay one graph per batch size
(`ProposalPasses`), as the target's decode steps do. An EAGLE-3 head's proposal passes are
captured alike; its catch-up runs eagerly on the hidden states the target's steps, captured
or not, leave in one buffer (`LlamaForCausalLM.keep_aux_hidden_states`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata
from liteinfer.config import EngineConfig, ModelConfig, SpeculativeConfig
from liteinfer.engine.cuda_graph import CUDAGraphRunner, GraphsBySize
from liteinfer.engine.input_layout import step_input_layout
from liteinfer.engine.pending_tokens import PendingTokens
from liteinfer.engine.prompt_graph import PromptGraphRunner, capture_step_graphs
from liteinfer.engine.runner_output import (
    DraftPlan,
    HeadCatchUp,
    ProposalPlan,
    ProposedDrafts,
)
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_splits import DecodeSplits
from liteinfer.layers.ops import StepScratch
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


class ProposalPasses:
    """A drafter's proposal passes of one token a sequence, over device buffers that each pass
    advances in place (a sequence's next token and its position), so that one pass can be
    captured and replayed k times. `step(ids, positions, meta)`: the drafter's next tokens.
    Captured (`capture`), a pass replays the graph of the smallest batch size that holds the
    sequences (`GraphsBySize`, as the target's decode steps), its padding rows reading and
    writing no KV; otherwise it runs eagerly on the sequences' rows alone."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                                      torch.Tensor],
                 step_model: StepModel, max_num_seqs: int, table_width: int, block_size: int,
                 device: torch.device):
        self.step = step
        self.step_model = step_model
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_num_seqs, table_width, dtype=torch.int32,
                                        device=device)
        self.num_rows = torch.zeros((), dtype=torch.int64, device=device)  # the rest pad
        self.graphs: GraphsBySize[torch.Tensor] | None = None

    def capture(self, pool) -> None:
        self.graphs = GraphsBySize(self._forward, self.step_model.splits, self.max_num_seqs,
                                   pool)

    def _forward(self, bs: int, may_split: bool) -> torch.Tensor:
        """One pass over the first `bs` rows; returns their new tokens (the ids buffer)."""
        ids, tables = self.ids[:bs], self.block_tables[:bs]
        real = torch.arange(bs, device=ids.device) < self.num_rows
        # Padding rows sit at position 0, whatever their buffers hold from earlier passes.
        positions = torch.where(real, self.positions[:bs], 0)
        blocks = tables.gather(1, (positions // self.block_size)[:, None])[:, 0].to(torch.int64)
        slots = blocks * self.block_size + positions % self.block_size
        context_lens = torch.where(real, positions + 1, 0).to(torch.int32)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.where(real, slots, -1),
                                 context_lens=context_lens, block_tables=tables,
                                 cu_seqlens_q=None)
        sm = self.step_model
        if sm.splits is not None:
            sm.set_split_k(meta, bs, may_split)  # split counts are chosen on the device
        else:  # the torch backends read the lengths on the host (never captured)
            meta.query_lens_host = [1] * bs
            meta.context_lens_host = context_lens.tolist()
        ids.copy_(self.step(ids, positions, meta))
        self.positions[:bs].add_(1)
        return ids

    def run(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
            num_passes: int, may_split: bool) -> torch.Tensor:
        """[S, num_passes]: each sequence's tokens after its token `ids` at `positions` (one
        a sequence, on the device), in its reserved blocks."""
        n = ids.shape[0]
        bs = n if self.graphs is None else self.graphs.size_for(n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.block_tables[:n].copy_(block_tables)
        self.num_rows.fill_(n)
        proposed = torch.empty(n, num_passes, dtype=torch.int64, device=ids.device)
        for j in range(num_passes):
            out = (self._forward(bs, may_split) if self.graphs is None
                   else self.graphs.replay(bs, may_split))
            proposed[:, j] = out[:n]
        return proposed


class DraftModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, pending: PendingTokens,
                 config: EngineConfig, table_width: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = config.block_size
        self.table_width = table_width
        self.device = device
        cfg = model.config
        tp = config.tensor_parallel_size
        num_kv_heads = cfg.num_key_value_heads // tp
        # The draft's own decode workspace (its heads' shape); its layers share the target's
        # split-K workspace (LayerOps.scratch). Freed with its graphs (`release`).
        self.scratch = StepScratch()
        if config.attention_backend == "triton":
            self.scratch.decode = DecodeSplits.allocate(
                config.split_workspace_rows, cfg.num_attention_heads // tp, num_kv_heads,
                cfg.head_dim, num_sms(device), device)
        # Pending tokens are read where the target's steps read them.
        self.step_model = StepModel(model, pending, self.scratch, device,
                                    step_input_layout(config, table_width, self.scratch.decode))
        self.config = config
        self.proposals = ProposalPasses(self._propose, self.step_model, config.max_num_seqs,
                                        table_width, self.block_size, device)
        self.graphs: CUDAGraphRunner | None = None
        self.prompt_graphs: PromptGraphRunner | None = None

    def capture_graphs(self, pool) -> None:
        """Captures the passes over a step's tokens (where the target's steps are captured,
        and in the same pool) and the proposal passes."""
        self.graphs, self.prompt_graphs = capture_step_graphs(self.step_model, self.config, pool,
                                                              logits=False)
        self.proposals.capture(pool)

    def release(self) -> None:
        """Frees the captured graphs, the scratch buffers and the input buffer; no pass runs
        after it."""
        self.graphs = self.prompt_graphs = self.proposals.graphs = None
        self.scratch.free()
        self.step_model.release()

    @torch.inference_mode()
    def before_step(self, batch: StepBatch) -> DraftPlan | None:
        """Runs the draft model over the step's tokens (launched before the step samples: its
        pending tokens are read from the step before's samples), and plans the proposals
        after it if it asks for some."""
        if self.graphs is not None and not batch.is_prefill:
            self.graphs.replay(self.graphs.stage(batch))
        elif self.prompt_graphs is not None and self.prompt_graphs.fits(batch):
            self.prompt_graphs.run(batch)
        else:
            ids, positions, meta, _, _ = self.step_model.prepare(batch)
            self.model(ids, positions, meta)
        proposals = self._plan(batch)
        return None if proposals is None else DraftPlan(proposals)

    def _plan(self, batch: StepBatch) -> ProposalPlan | None:
        k = batch.num_lookahead_tokens
        if not k:
            return None
        max_drafts = max((batch.num_drafts(i) for i in range(len(batch.seqs))), default=0)
        seq_indices, rows, drafts, base, tables, ends = [], [], [], [], [], []
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
            ends.append(end + k)  # bounds the proposals' context lengths
            table = np.zeros(self.table_width, dtype=np.int64)
            table[:len(seq.block_table)] = seq.block_table
            tables.append(table)
        if not seq_indices:
            return None
        splits = self.step_model.splits
        def as_tensor(data, dtype):
            return to_device(np.array(data, dtype=np.int64), dtype, self.device)
        return ProposalPlan(k, seq_indices, as_tensor(rows, torch.int64),
                            as_tensor(drafts, torch.int64).view(len(seq_indices), max_drafts),
                            as_tensor(base, torch.int64), as_tensor(tables, torch.int32),
                            splits is not None and splits.may_split(ends))

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
        proposed = self.proposals.run(ids, p.base + accepted, p.block_tables, p.num_tokens,
                                      p.may_split)
        return ProposedDrafts(proposed, p.seq_indices)

    def _propose(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor:
        """The draft model's greedy next tokens (a proposal pass's step)."""
        return self.model.compute_logits(self.model(ids, positions, meta)).argmax(dim=-1)


class Eagle3Runner(DraftModelRunner):
    """An EAGLE-3 head (models/eagle3.py) as the drafter. At position p it reads the token at
    p + 1, so its pass over a step's tokens waits for the step's samples: once the step is
    sampled it catches up (with the target's hidden states of the step) and its output at each
    proposing sequence's last accepted position gives the first draft; k - 1 passes of one
    token a sequence, on its own hidden states, give the others."""

    def __init__(self, model: Eagle3LlamaForCausalLM, target: LlamaForCausalLM,
                 decode_rows: Callable[[StepBatch], int], kv_cache: torch.Tensor,
                 pending: PendingTokens, config: EngineConfig, table_width: int,
                 device: torch.device):
        """`decode_rows(batch)`: the rows the step's decoding sequences take at the head of the
        target's hidden states (more than there are where a captured step pads them)."""
        super().__init__(model, kv_cache, pending, config, table_width, device)
        self.target = target
        self.decode_rows = decode_rows
        # The head's output at each proposing sequence's newest token: the next pass's input.
        self.hidden = torch.zeros(config.max_num_seqs, model.config.hidden_size,
                                  dtype=config.torch_dtype, device=device)

    def capture_graphs(self, pool) -> None:
        """Captures the proposal passes. The catch-up runs eagerly: it follows the target's
        captured step, on the hidden states that step kept (`keep_aux_hidden_states`)."""
        self.proposals.capture(pool)

    @torch.inference_mode()
    def before_step(self, batch: StepBatch) -> DraftPlan:
        _, positions, meta, sample_rows, _ = self.step_model.prepare(batch)
        next_ids = np.zeros(sum(batch.num_tokens), dtype=np.int64)
        drafts = batch.draft_token_ids or [[]] * len(batch.seqs)
        start = 0
        for seq, n, d in zip(batch.seqs, batch.num_tokens, drafts):
            c = seq.num_computed_tokens
            after = seq.token_ids[c + 1:c + 1 + n]
            after += d[:n - len(after)]  # a verifying sequence's tokens go on with its drafts
            next_ids[start:start + len(after)] = after
            start += n
        # Where the target's pass leaves each token's hidden states.
        d = batch.num_decodes
        aux_rows = np.arange(len(next_ids))
        aux_rows[d:] += self.decode_rows(batch) - d
        catch_up = HeadCatchUp(to_device(next_ids, torch.int64, self.device), positions, meta,
                               sample_rows, to_device(aux_rows, torch.int64, self.device))
        return DraftPlan(self._plan(batch), catch_up)

    @torch.inference_mode()
    def after_sampling(self, plan: DraftPlan, sampled: torch.Tensor) -> ProposedDrafts | None:
        """`self.target.aux_hidden_states`: the target's, from this step's forward pass (no
        other pass of the target runs between a step's launch and its sampling)."""
        c = plan.catch_up
        next_ids = c.next_ids.index_put((c.sample_rows,), sampled)
        head = self.model
        hidden = head(next_ids, c.positions, c.meta, self.target.aux_hidden_states[c.aux_rows])
        p = plan.proposals
        if p is None:
            return None
        accepted, _ = self._accepted(p, sampled)
        hidden = hidden[c.sample_rows[p.sample_rows.gather(1, accepted[:, None])[:, 0]]]
        ids = head.to_target_ids(head.compute_logits(hidden).argmax(dim=-1))
        self.hidden[:ids.shape[0]].copy_(hidden)
        rest = self.proposals.run(ids, p.base + accepted, p.block_tables, p.num_tokens - 1,
                                  p.may_split)
        return ProposedDrafts(torch.cat([ids[:, None], rest], dim=1), p.seq_indices)

    def _propose(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> torch.Tensor:
        """The head's greedy next tokens on its own hidden states, which it advances."""
        hidden = self.hidden[:ids.shape[0]]
        hidden.copy_(self.model(ids, positions, meta, hidden))
        head = self.model
        return head.to_target_ids(head.compute_logits(hidden).argmax(dim=-1))
