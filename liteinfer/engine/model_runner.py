"""Runs one scheduled step: its inputs as tensors, the model (eager or a captured graph), the
sampler, and the logprobs of prompt tokens that asked for them."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from liteinfer.attention import allocate_kv_pool, get_backend, kv_cache_dtype
from liteinfer.attention.batch_invariant import BatchInvariantBackend
from liteinfer.config import NARROW_VERIFICATIONS, EngineConfig, ModelConfig
from liteinfer.engine.cuda_graph import CUDAGraphRunner, StagedDecode
from liteinfer.engine.draft_runner import (
    DraftModelRunner,
    Eagle3Runner,
    eagle3_settings,
    load_draft_source,
)
from liteinfer.engine.input_layout import step_input_layout
from liteinfer.engine.instrumentation import DECODE_GRAPH, EAGER, PROMPT_GRAPH, StepRun
from liteinfer.engine.messages import TokenLogprobs
from liteinfer.engine.pending_tokens import PendingTokens
from liteinfer.engine.prompt_buckets import PromptBuckets
from liteinfer.engine.prompt_graph import capture_step_graphs
from liteinfer.engine.request_state import CachedRequestState, RequestStates
from liteinfer.engine.runner_output import ModelRunnerOutput, StepForward
from liteinfer.engine.sampler import Sampler, below_min_tokens, logprob_entries, logprob_table
from liteinfer.engine.scheduler_output import SchedulerOutput
from liteinfer.engine.step_batch import StepBatch
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_splits import DecodeSplits
from liteinfer.kernels.gemm_splits import SplitKWorkspace
from liteinfer.layers.batch_invariant import BatchInvariantConfig
from liteinfer.layers.ops import LayerOps, StepScratch
from liteinfer.layers.quantization import (
    GGUFConfig,
    QuantConfig,
    process_weights_after_loading,
    quant_config,
    split_k_launches,
)
from liteinfer.layers.rotary import cos_sin_cache
from liteinfer.loader import ModelSource
from liteinfer.models import model_class
from liteinfer.models.eagle3 import Eagle3LlamaForCausalLM
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.structured_output.manager import GrammarBitmask
from liteinfer.utils import cdiv, free_device_memory

# Prompt rows scored at once: their fp32 logits over a 128k vocabulary take 256 MiB.
PROMPT_LOGPROB_ROWS = 512


@dataclass(frozen=True)
class KVPoolSize:
    """What the runner derives from the memory it finds: the KV pool's blocks and the longest
    sequence the engine serves (max_model_len, or less where a default would not fit)."""

    num_blocks: int
    max_model_len: int


@dataclass
class StagedStep:
    """A step applied to the runner's request states, ready to launch."""

    batch: StepBatch[CachedRequestState]
    # Sampling rows whose request had fewer outputs than its min_tokens before the step: taken
    # here, as the states may move on to the next step before this one is sampled.
    below_min_tokens: list[int]
    decode: StagedDecode | None  # a captured decode step's inputs, sent already


class ModelRunner:
    """Owns the model, the KV pool, the sampler, (on CUDA) the captured decode and prompt
    graphs, and its own state of every request it runs: each step's SchedulerOutput is applied
    to it (`stage`), the same way on every tensor-parallel rank."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, source: ModelSource,
                 load_format: str, eos_token_ids: list[int], tp_rank: int = 0):
        """`config`: resolved (engine/core.py `resolve_config`). The runner reports what it
        derives from the memory it finds in `kv_pool`, which the engine core builds its
        configuration from."""
        self.model_config = model_config
        self.config = config
        self.requests = RequestStates()
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        # This rank's heads (all of them on one rank).
        self.num_q_heads = model_config.num_attention_heads // self.tp_size
        self.num_kv_heads = model_config.num_key_value_heads // self.tp_size
        self.device = torch.device(config.device)
        self.dtype: torch.dtype = config.torch_dtype
        self.block_size = config.block_size
        # The longest sequence asked for; the KV pool may hold less (`kv_pool`).
        max_model_len = config.max_model_len or model_config.max_context
        # Query heads per KV head: prefill attention's tiles hold all of a group's heads.
        self.query_group_size = self.num_q_heads // self.num_kv_heads
        self.use_triton = config.attention_backend == "triton"
        # Every step's scratch buffers, the draft model's layers' too: allocated once the
        # models are loaded, freed with the graphs (`release`).
        self.scratch = StepScratch()
        self.backend = (BatchInvariantBackend(self.use_triton) if config.batch_invariant
                        else get_backend(config.attention_backend))
        self.model = self._load_model(model_config, source, load_format, max_model_len)
        # A draft model (speculative decoding) is loaded before the KV pools are sized: its
        # pool holds as many blocks as the target's, which share one budget.
        spec = config.speculative
        draft = None
        if spec is not None and spec.drafts_on_device:
            draft_config, draft_source = load_draft_source(spec, model_config, load_format,
                                                           max_model_len, config)
            if spec.method == "eagle3":
                draft = self._load_eagle3_head(draft_config, draft_source, max_model_len)
            else:
                draft = self._load_model(draft_config, draft_source, draft_source.load_format,
                                         max_model_len)
        self.kv_pool = self._size_kv_pool(draft, max_model_len)
        self.max_blocks_per_seq = cdiv(self.kv_pool.max_model_len, self.block_size)
        self.kv_cache = self._bind_kv_pool(self.model)
        sms = num_sms(self.device)
        if self.use_triton:
            self.scratch.decode = DecodeSplits.allocate(
                config.split_workspace_rows, self.num_q_heads, self.num_kv_heads,
                model_config.head_dim, sms, self.device)
        self.scratch.split_k = SplitKWorkspace.allocate(
            [launch for m in (self.model, draft) if m is not None
             for launch in split_k_launches(m, sms)], self.device)
        self.step_model = StepModel(self.model, PendingTokens(config.max_sampled_rows, self.device),
                                    self.scratch, self.device,
                                    step_input_layout(config, self.max_blocks_per_seq,
                                                      self.scratch.decode),
                                    config.batch_invariant)
        self.sampler = Sampler(eos_token_ids, use_triton=self.use_triton)
        self.drafter: DraftModelRunner | None = None
        if isinstance(draft, Eagle3LlamaForCausalLM):
            self.drafter = Eagle3Runner(draft, self.model, self._decode_rows,
                                        self._bind_kv_pool(draft),
                                        self.step_model.pending, config,
                                        self.max_blocks_per_seq, self.device)
        elif draft is not None:
            self.drafter = DraftModelRunner(draft, self._bind_kv_pool(draft),
                                            self.step_model.pending, config,
                                            self.max_blocks_per_seq, self.device)
        self.graphs = self.prompt_graphs = None
        # Decode steps of verifications, by query tokens a sequence (`_verify_width`).
        self.verify_graphs: dict[int, CUDAGraphRunner] = {}
        if self.device.type == "cuda" and self.use_triton and not config.enforce_eager:
            pool = torch.cuda.graph_pool_handle()  # one pool: graphs replay one at a time
            self.graphs, self.prompt_graphs = capture_step_graphs(self.step_model, config, pool)
            if self.drafter is not None:
                self.drafter.capture_graphs(pool)
            elif spec is not None and not config.batch_invariant:
                self.capture_verify_graphs(pool)

    def capture_verify_graphs(self, pool) -> None:
        """Decode steps of verifications of 2 to 1 + num_speculative_tokens query tokens a
        sequence, of every batch size `_verify_width` takes."""
        max_seqs = min(self.config.max_num_seqs, NARROW_VERIFICATIONS)
        self.verify_graphs = {
            q: CUDAGraphRunner(self.step_model, max_seqs, pool, query_len=q)
            for q in range(2, self.config.num_speculative_tokens + 2)}

    @property
    def prompt_buckets(self) -> PromptBuckets | None:
        """The buckets of the captured prompt and mixed steps, which the scheduler trims mixed
        steps to (None: no prompt step is captured; they run eagerly at any size)."""
        return None if self.prompt_graphs is None else self.prompt_graphs.layout.prompt_buckets

    def release(self) -> None:
        """Frees the captured graphs, the step's scratch buffers and its input buffer; the runner
        runs no step after it. A tensor-parallel rank does so before leaving its group: NCCL's
        teardown hangs while graphs that captured its collectives live
        (pytorch/pytorch#115388)."""
        self.graphs = self.prompt_graphs = None
        self.verify_graphs = {}
        self.scratch.free()
        self.step_model.release()
        if self.drafter is not None:
            self.drafter.release()
        if self.device.type == "cuda":
            free_device_memory()

    def _load_eagle3_head(self, cfg: ModelConfig, source: ModelSource, max_model_len: int
                          ) -> Eagle3LlamaForCausalLM:
        """The head, reading the target's token embedding unless it has its own, and the
        target set to keep the hidden states it reads."""
        draft_vocab, aux_layers = eagle3_settings(source.hf_config, self.model_config)
        head = self._load_model(cfg, source, source.load_format, max_model_len, lambda ops: (
            Eagle3LlamaForCausalLM(cfg, draft_vocab, self.model_config.hidden_size,
                                   self.backend, ops)))
        if not head.has_own_embedding:
            head.share_embedding(self.model)
        # Room for any step's tokens: a prompt budget's, a verification step's (every sequence
        # with its drafts), a captured prompt step's with its padding.
        config = self.config
        max_tokens = max(config.max_num_batched_tokens, config.max_sampled_rows,
                         config.max_num_seqs + config.mixed_prompt_tokens)
        self.model.keep_aux_hidden_states(aux_layers, max_tokens, self.dtype, self.device)
        return head

    @torch.inference_mode()
    def _load_model(self, cfg: ModelConfig, source: ModelSource, load_format: str,
                    max_model_len: int, build: Callable[[LayerOps], nn.Module] | None = None
                    ) -> Any:
        """`build`: the model from its layer ops (default: the family's class of `cfg`); its
        RoPE table covers `max_model_len` positions."""
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # Parameters are created on the device and filled tensor by tensor: the checkpoint
            # is never held twice.
            with torch.device(self.device):
                quant = quant_config(self.config.quantization, source.hf_config, load_format)
                ops = self._layer_ops(quant, cfg)
                model = (build(ops) if build is not None
                         else model_class(cfg)(cfg, self.backend, ops))
        finally:
            torch.set_default_dtype(default_dtype)
        if load_format == "dummy":
            model.init_dummy_weights(self.config.seed)
        else:
            model.load_weights(source.iter_weights())
        process_weights_after_loading(model)
        model.cos_sin_cache = cos_sin_cache(cfg.head_dim, max_model_len, cfg.rope_theta,
                                            cfg.rope_scaling, self.device)
        return model.eval()

    def _layer_ops(self, quant: QuantConfig | None, cfg: ModelConfig) -> LayerOps:
        """The layers' kernels. Batch-invariant mode multiplies in the model dtype: a GGUF
        file's blocks are dequantized at load; other quantized checkpoints and the experts'
        kernels are refused for now."""
        if not self.config.batch_invariant:
            return LayerOps(triton=self.use_triton, gemv=self.use_triton, quant=quant,
                            tp_rank=self.tp_rank, tp_size=self.tp_size, scratch=self.scratch)
        if cfg.moe is not None:
            raise ValueError("batch_invariant does not support mixture-of-experts models yet")
        linears: GGUFConfig | BatchInvariantConfig = BatchInvariantConfig()
        if isinstance(quant, GGUFConfig) and quant.requantize is None:
            linears = dataclasses.replace(quant, requantize=linears)
        elif quant is not None:
            raise ValueError("batch_invariant does not support quantized checkpoints yet")
        return LayerOps(triton=self.use_triton, quant=linears, invariant=True,
                        tp_rank=self.tp_rank, tp_size=self.tp_size, scratch=self.scratch)

    def _kv_block_bytes(self, model: LlamaForCausalLM) -> int:
        cfg = model.config
        shape = (2, cfg.num_hidden_layers, self.block_size,
                 cfg.num_key_value_heads // self.tp_size, cfg.head_dim)
        return torch.Size(shape).numel() * self.kv_dtype.itemsize

    @property
    def kv_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)

    def _size_kv_pool(self, draft: LlamaForCausalLM | None, max_model_len: int) -> KVPoolSize:
        """The KV pool's blocks, from `num_kv_blocks` or the memory left, and the longest
        sequence they hold (at most `max_model_len`); `draft`: a draft model whose pool of as
        many blocks shares the budget (allocated by `_bind_kv_pool`)."""
        block_bytes = self._kv_block_bytes(self.model)
        if draft is not None:
            block_bytes += self._kv_block_bytes(draft)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        else:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = free * self.config.gpu_memory_utilization - self._activation_bytes()
            else:
                budget = self.config.cpu_kv_cache_gb * 2**30
            # More blocks than every sequence at full length could use would sit idle.
            num_blocks = min(int(budget // block_bytes),
                             self.config.max_num_seqs * cdiv(max_model_len, self.block_size) + 1)
        # Rank 0's block ids (or, under torchrun, every rank's scheduler's) index every pool.
        if self.tp_size > 1:
            agreed = torch.tensor([num_blocks], device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(agreed.item())
        fitted = self.model_config.fit_max_model_len(
            max_model_len, self.config.max_model_len is not None, num_blocks * self.block_size)
        return KVPoolSize(num_blocks, fitted)

    def _bind_kv_pool(self, model: LlamaForCausalLM) -> torch.Tensor:
        """A KV pool of `kv_pool.num_blocks` blocks for `model`, bound to its attention
        layers."""
        cfg = model.config
        kv = allocate_kv_pool(2, cfg.num_hidden_layers, num_blocks=self.kv_pool.num_blocks,
                              block_size=self.block_size,
                              num_kv_heads=cfg.num_key_value_heads // self.tp_size,
                              head_dim=cfg.head_dim, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0, i], kv[1, i]
        return kv

    def _activation_bytes(self) -> int:
        """Room for a full prefill step's activations and logits beside the pool."""
        cfg = self.model_config
        tokens = self.config.max_num_batched_tokens
        width = cfg.hidden_size * 4 + cfg.intermediate_size * 3
        return (tokens * width + self.config.max_num_seqs * cfg.vocab_size * 2) * 4

    def stage(self, out: SchedulerOutput) -> StagedStep:
        """Applies the step to the request states and, for a captured decode step, sends its
        inputs ahead of its launch (`forward`/`execute`), e.g. while the step before it waits to
        be sampled; other steps' inputs go with their launch. The pending tokens are read at
        the launch."""
        batch = self.requests.apply(out)
        decode = None
        if self._replays_decode(batch):
            decode = self.graphs.stage(batch)
        elif (verify := self._verify_graphs(batch)) is not None:
            decode = verify.stage(batch)
        return StagedStep(batch, below_min_tokens(batch.sampling_seqs), decode)

    def execute(self, step: StagedStep) -> ModelRunnerOutput:
        """Launches one step and its sampling without waiting for the device. The sampled
        tokens stay in the step model's buffer, where the next step reads the pending ones."""
        return self.sample(step, self.forward(step))

    @torch.inference_mode()
    def forward(self, step: StagedStep) -> StepForward:
        """Launches the step's forward pass (and scores the prompt tokens that asked for
        logprobs); `sample` follows, at once or once the constrained rows' bitmask is known."""
        batch = step.batch
        # The draft model reads the step's pending tokens before the step's samples replace them.
        plan = None if self.drafter is None else self.drafter.before_step(batch)
        logits, prompt_hidden = self._forward(step)
        self.requests.launched(batch)
        prompt_logprobs = ([] if prompt_hidden is None else
                           self._prompt_logprobs(batch, prompt_hidden))
        return StepForward(logits, prompt_logprobs, plan)

    @torch.inference_mode()
    def sample(self, step: StagedStep, forward: StepForward,
               grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Samples the launched step's rows (`grammar_bitmask` masks the constrained ones)
        before any later step is launched: the logits may sit in a captured graph's output."""
        if forward.logits is None:
            if forward.draft_plan is not None:  # an EAGLE-3 head catches up all the same
                self.drafter.after_sampling(forward.draft_plan, torch.empty(
                    0, dtype=torch.int64, device=self.device))
            return ModelRunnerOutput(None, forward.prompt_logprobs)
        sampled = self.sampler.sample(forward.logits, step.batch.sampling_seqs,
                                      step.below_min_tokens, grammar_bitmask)
        self.step_model.pending.keep(sampled.token_ids)
        drafts = None
        if forward.draft_plan is not None:
            drafts = self.drafter.after_sampling(forward.draft_plan, sampled.token_ids)
        return ModelRunnerOutput(sampled, forward.prompt_logprobs, drafts)

    def _forward(self, step: StagedStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the rows that sample ([rows, vocab], None if none do) and the final
        hidden states of the rows scoring prompt tokens (None if none do)."""
        batch = step.batch
        if step.decode is not None:
            q = step.decode.query_len
            graphs = self.graphs if q == 1 else self.verify_graphs[q]
            return graphs.replay(step.decode), None
        prompt_hidden = None
        if self._replays_prompt(batch):
            hidden, rows = self.prompt_graphs.run(batch)
        else:
            input_ids, positions, meta, rows, prompt_rows = self.step_model.prepare(
                batch, self._verify_width(batch))
            hidden = self.model(input_ids, positions, meta)
            if prompt_rows is not None:
                prompt_hidden = hidden[prompt_rows]
        return (self.model.compute_logits(hidden[rows]) if rows.numel() else None), prompt_hidden

    def _decode_rows(self, batch: StepBatch) -> int:
        """Rows the step's decoding sequences take at the head of its hidden states (and of
        the model's `aux_hidden_states`): a captured prompt step pads them to its bucket."""
        if self._replays_prompt(batch):
            return self.prompt_graphs.layout.bucket(batch)[0]
        return batch.num_decodes

    def _replays_decode(self, batch: StepBatch) -> bool:
        return not batch.is_prefill and self.graphs is not None

    def _verify_width(self, batch: StepBatch) -> int:
        """Query tokens a sequence where the step runs as a decode step of verifications (its
        `verification_width`), 0 where it runs as a prompt step: the host proposers' steps
        (a draft model's catch-up reads a prompt step's rows), outside batch-invariant mode,
        of up to NARROW_VERIFICATIONS sequences, whose tokens have rows in the split-K
        workspace. Wider steps are the device's time more than the host's, and keep the
        prompt step's path."""
        if (self.drafter is not None or self.config.batch_invariant
                or len(batch.seqs) > NARROW_VERIFICATIONS):
            return 0
        return batch.verification_width()

    def _verify_graphs(self, batch: StepBatch) -> CUDAGraphRunner | None:
        """The captured decode steps of verifications that replay the step, if any."""
        return self.verify_graphs.get(self._verify_width(batch))

    def _replays_prompt(self, batch: StepBatch) -> bool:
        return (self.prompt_graphs is not None and not batch.prompt_logprob_spans
                and self.prompt_graphs.fits(batch) and not self._verify_width(batch))

    def describe(self, batch: StepBatch) -> StepRun:
        """How `forward` runs the step (the scheduler's view of it or the runner's): eagerly
        or as which captured graph (instrumentation)."""
        if self._replays_decode(batch):
            return StepRun(DECODE_GRAPH, (self.graphs.size_for(len(batch.seqs)),))
        if (verify := self._verify_graphs(batch)) is not None:
            return StepRun(DECODE_GRAPH, (verify.size_for(len(batch.seqs)), verify.query_len))
        if self._replays_prompt(batch):
            return StepRun(PROMPT_GRAPH, self.prompt_graphs.layout.bucket(batch))
        return StepRun(EAGER)

    def _prompt_logprobs(self, batch: StepBatch[CachedRequestState], hidden: torch.Tensor
                         ) -> list[list[TokenLogprobs]]:
        """The prompt tokens' logprobs (and each sequence's top-N) of the step's rows scoring
        them (`batch.prompt_logprob_spans`, in order; their final hidden states). Logits are
        taken PROMPT_LOGPROB_ROWS rows at a time, so that a long prompt chunk never holds
        [tokens, vocab] at once, and read back at once: a request asking for prompt logprobs
        gives up the overlap of its prompt steps."""
        targets, tops, counts = [], [], []
        for i, first, n in batch.prompt_logprob_spans:
            seq = batch.seqs[i]
            pos = seq.num_computed_tokens + first
            targets += seq.token_ids[pos + 1:pos + 1 + n]
            tops += [seq.sampling_params.prompt_logprobs] * n
            counts.append(n)
            seq.num_prompt_logprobs += n
        k = max(tops)
        entries: list[TokenLogprobs] = []
        for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            end = start + PROMPT_LOGPROB_ROWS
            ids = torch.tensor(targets[start:end], device=hidden.device)
            table = logprob_table(self.model.compute_logits(hidden[start:end]), ids, k)
            entries += logprob_entries(table.tolist(), tops[start:end], k)
        spans, at = [], 0
        for n in counts:
            spans.append(entries[at:at + n])
            at += n
        return spans
