"""Runs one scheduled step: its inputs as tensors, the model (eager or a captured graph), the
sampler, and the logprobs of prompt tokens that asked for them."""
from __future__ import annotations

import dataclasses

import torch

from liteinfer.attention import AttentionMetadata, allocate_kv_pool, get_backend, kv_cache_dtype
from liteinfer.attention.batch_invariant import BatchInvariantBackend
from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.cuda_graph import CUDAGraphRunner, StagedDecode
from liteinfer.engine.messages import TokenLogprobs
from liteinfer.engine.runner_output import ModelRunnerOutput, StepForward
from liteinfer.engine.sampler import Sampler, logprob_entries, logprob_table
from liteinfer.engine.scheduler import SchedulerOutput
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.engine.step_model import StepModel
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens
from liteinfer.layers.batch_invariant import BatchInvariantConfig
from liteinfer.layers.quantization import (
    GGUFConfig,
    QuantConfig,
    process_weights_after_loading,
    quant_config,
)
from liteinfer.layers.rotary import cos_sin_cache
from liteinfer.loader import ModelSource
from liteinfer.models import model_class
from liteinfer.models.llama import LayerOps, LlamaForCausalLM
from liteinfer.structured_output.manager import GrammarBitmask
from liteinfer.utils import cdiv, free_device_memory, to_device

# Prompt rows scored at once: their fp32 logits over a 128k vocabulary take 256 MiB.
PROMPT_LOGPROB_ROWS = 512


class ModelRunner:
    """Owns the model, the KV pool, the sampler and (on CUDA) the captured decode and prompt
    graphs."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, source: ModelSource,
                 load_format: str, max_model_len: int, eos_token_ids: list[int],
                 tp_rank: int = 0):
        self.model_config = model_config
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        # This rank's heads (all of them on one rank).
        self.num_q_heads = model_config.num_attention_heads // self.tp_size
        self.num_kv_heads = model_config.num_key_value_heads // self.tp_size
        self.device = torch.device(config.device)
        self.dtype: torch.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        # Query heads per KV head: prefill attention's tiles hold all of a group's heads.
        self.query_group_size = self.num_q_heads // self.num_kv_heads
        self.use_triton = config.attention_backend == "triton"
        self.backend = (BatchInvariantBackend(self.use_triton) if config.batch_invariant
                        else get_backend(config.attention_backend))
        self.model = self._load_model(source, load_format)
        self.kv_cache = self._allocate_kv_cache()
        sms = num_sms(self.device)
        workspace = None
        if self.use_triton:
            workspace = DecodeWorkspace.allocate(
                config.max_num_seqs, self.num_q_heads, model_config.head_dim,
                max_splits_for(1, self.num_kv_heads, sms), self.device)
        # A sequence verifying drafts samples a row per draft beside its next token's.
        max_sampled_rows = config.max_num_seqs * (1 + config.num_speculative_tokens)
        self.step_model = StepModel(self.model, max_sampled_rows, self.num_kv_heads,
                                    model_config.head_dim, sms,
                                    workspace, self.device)
        self.sampler = Sampler(eos_token_ids, use_triton=self.use_triton)
        self.graphs = self.prompt_graphs = None
        if self.device.type == "cuda" and self.use_triton and not config.enforce_eager:
            from liteinfer.engine.prompt_graph import PromptGraphRunner, PromptStepLayout
            pool = torch.cuda.graph_pool_handle()  # one pool: graphs replay one at a time
            # Batch-invariant attention takes a prompt step's query tiles from the host, which
            # a captured prompt step does not have: those steps run eagerly in that mode.
            if not config.batch_invariant:
                layout = PromptStepLayout(config.max_num_seqs, config.mixed_prompt_tokens,
                                          self.max_blocks_per_seq, self.block_size,
                                          self.query_group_size,
                                          self.step_model.max_decode_splits)
                self.prompt_graphs = PromptGraphRunner(self.step_model, layout,
                                                       model_config.hidden_size, self.dtype,
                                                       self.device, pool)
            self.graphs = CUDAGraphRunner(self.step_model, config.max_num_seqs,
                                          self.max_blocks_per_seq, self.block_size,
                                          self.device, pool)

    def release_graphs(self) -> None:
        """Frees the captured graphs. A tensor-parallel rank does so before leaving its group:
        NCCL's teardown hangs while graphs that captured its collectives live
        (pytorch/pytorch#115388)."""
        self.graphs = self.prompt_graphs = None
        free_device_memory()

    @torch.inference_mode()
    def _load_model(self, source: ModelSource, load_format: str) -> LlamaForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # Parameters are created on the device and filled tensor by tensor: the checkpoint
            # is never held twice.
            with torch.device(self.device):
                ops = self._layer_ops(quant_config(self.config.quantization, source.hf_config,
                                                   load_format))
                model = model_class(self.model_config)(self.model_config, self.backend, ops,
                                                       self.tp_rank, self.tp_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if load_format == "dummy":
            model.init_dummy_weights(self.config.seed)
        else:
            model.load_weights(source.iter_weights())
        process_weights_after_loading(model)
        cfg = self.model_config
        model.cos_sin_cache = cos_sin_cache(cfg.head_dim, self.max_model_len, cfg.rope_theta,
                                            cfg.rope_scaling, self.device)
        return model.eval()

    def _layer_ops(self, quant: QuantConfig | None) -> LayerOps:
        """The layers' kernels. Batch-invariant mode multiplies in the model dtype: a GGUF
        file's blocks are dequantized at load; other quantized checkpoints and the experts'
        kernels are refused for now."""
        if not self.config.batch_invariant:
            return LayerOps(triton=self.use_triton, gemv=self.use_triton, quant=quant)
        if self.model_config.moe is not None:
            raise ValueError("batch_invariant does not support mixture-of-experts models yet")
        linears: GGUFConfig | BatchInvariantConfig = BatchInvariantConfig()
        if isinstance(quant, GGUFConfig) and quant.requantize is None:
            linears = dataclasses.replace(quant, requantize=linears)
        elif quant is not None:
            raise ValueError("batch_invariant does not support quantized checkpoints yet")
        return LayerOps(triton=self.use_triton, quant=linears, invariant=True)

    def _allocate_kv_cache(self) -> torch.Tensor:
        cfg = self.model_config
        shape = (2, cfg.num_hidden_layers, self.block_size, self.num_kv_heads, cfg.head_dim)
        dtype = kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)
        block_bytes = torch.Size(shape).numel() * dtype.itemsize
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
                             self.config.max_num_seqs * self.max_blocks_per_seq + 1)
        # Rank 0's block ids (or, under torchrun, every rank's scheduler's) index every pool.
        if self.tp_size > 1:
            agreed = torch.tensor([num_blocks], device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(agreed.item())
        self.max_model_len = self.model_config.fit_max_model_len(
            self.max_model_len, self.config.max_model_len is not None,
            num_blocks * self.block_size)
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        self.num_kv_blocks = num_blocks
        kv = allocate_kv_pool(2, cfg.num_hidden_layers, num_blocks=num_blocks,
                              block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                              head_dim=cfg.head_dim, dtype=dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0, i], kv[1, i]
        return kv

    def _activation_bytes(self) -> int:
        """Room for a full prefill step's activations and logits beside the pool."""
        cfg = self.model_config
        tokens = self.config.max_num_batched_tokens
        width = cfg.hidden_size * 4 + cfg.intermediate_size * 3
        return (tokens * width + self.config.max_num_seqs * cfg.vocab_size * 2) * 4

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                       AttentionMetadata, torch.Tensor,
                                                       torch.Tensor | None]:
        """Token ids, positions, attention metadata, the rows whose logits are sampled and the
        rows scoring prompt tokens (`prompt_logprob_spans`; None if there are none)."""
        step = build_step_inputs(batch, self.block_size, self.max_blocks_per_seq)
        def as_tensor(data, dtype):
            return to_device(data, dtype, self.device)
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=as_tensor(step.slots, torch.int64),
            context_lens=as_tensor(step.context_lens, torch.int32),
            block_tables=as_tensor(step.block_tables, torch.int32),
            cu_seqlens_q=as_tensor(step.cu_seqlens, torch.int32) if batch.is_prefill else None,
            num_decodes=step.num_decodes if batch.is_prefill else 0,
            query_lens_host=step.query_lens.tolist(),
            context_lens_host=step.context_lens.tolist(),
        )
        sm = self.step_model
        if self.use_triton and batch.is_prefill:
            d = step.num_decodes
            meta.tile_tokens = prefill_tile_tokens(int(step.query_lens[d:].max()),
                                                   self.query_group_size)
            meta.tile_map = as_tensor(step.attention_tile_map(
                meta.tile_tokens, d, sm.max_decode_splits), torch.int32)
            meta.workspace = sm.decode_workspace
        elif self.use_triton:
            sm.set_split_k(meta, step.num_decodes, sm.rows_may_split(step.context_lens))
        ids = as_tensor(step.input_ids, torch.int32)
        if step.has_pending:
            ids = sm.with_pending(ids, as_tensor(step.pending_rows, torch.int32))
        # A device index: indexing with a host list would copy it synchronously and stall the
        # host until the whole step has run, instead of letting it prepare the next one.
        prompt_rows = as_tensor(step.prompt_rows, torch.int64) if len(step.prompt_rows) else None
        return (ids, as_tensor(step.positions, torch.int64), meta,
                as_tensor(step.sample_rows, torch.int64), prompt_rows)

    def execute(self, batch: SchedulerOutput, staged: StagedDecode | None = None
                ) -> ModelRunnerOutput:
        """Launches one step and its sampling without waiting for the device. The sampled
        tokens stay in the step model's buffer, where the next step reads the pending ones."""
        return self.sample(batch, self.forward(batch, staged))

    def stage(self, batch: SchedulerOutput) -> StagedDecode | None:
        """Sends a captured decode step's inputs ahead of its launch (`forward`/`execute` with
        the result), e.g. while the step before it waits to be sampled; None for other steps,
        whose inputs go with their launch. The pending tokens are read at the launch."""
        if not batch.is_prefill and self.graphs is not None:
            return self.graphs.stage(batch)
        return None

    @torch.inference_mode()
    def forward(self, batch: SchedulerOutput, staged: StagedDecode | None = None
                ) -> StepForward:
        """Launches the step's forward pass (and scores the prompt tokens that asked for
        logprobs); `sample` follows, at once or once the constrained rows' bitmask is known.
        `staged`: the step's inputs, sent already (`stage`)."""
        logits, prompt_hidden = self._forward(batch, staged)
        prompt_logprobs = ([] if prompt_hidden is None else
                           self._prompt_logprobs(batch, prompt_hidden))
        return StepForward(logits, prompt_logprobs)

    @torch.inference_mode()
    def sample(self, batch: SchedulerOutput, forward: StepForward,
               grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Samples the launched step's rows (`grammar_bitmask` masks the constrained ones)
        before any later step is launched: the logits may sit in a captured graph's output."""
        if forward.logits is None:
            return ModelRunnerOutput(None, forward.prompt_logprobs)
        sampled = self.sampler.sample(forward.logits, batch.sampling_seqs, grammar_bitmask)
        self.step_model.keep_sampled(sampled.token_ids)
        return ModelRunnerOutput(sampled, forward.prompt_logprobs)

    def _forward(self, batch: SchedulerOutput, staged: StagedDecode | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the rows that sample ([rows, vocab], None if none do) and the final
        hidden states of the rows scoring prompt tokens (None if none do)."""
        if not batch.is_prefill and self.graphs is not None:
            return self.graphs.replay(staged or self.graphs.stage(batch)), None
        prompt_hidden = None
        if (self.prompt_graphs is not None and not batch.prompt_logprob_spans
                and self.prompt_graphs.fits(batch)):
            hidden, rows = self.prompt_graphs.run(batch)
        else:
            input_ids, positions, meta, rows, prompt_rows = self.prepare(batch)
            hidden = self.model(input_ids, positions, meta)
            if prompt_rows is not None:
                prompt_hidden = hidden[prompt_rows]
        return (self.model.compute_logits(hidden[rows]) if rows.numel() else None), prompt_hidden

    def _prompt_logprobs(self, batch: SchedulerOutput, hidden: torch.Tensor
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
