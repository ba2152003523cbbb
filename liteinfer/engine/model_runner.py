"""Turns a scheduled batch into tensors, runs the model and returns the logits to sample from."""
from __future__ import annotations

import torch

from liteinfer.attention import AttentionMetadata, allocate_kv_pool, get_backend
from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.engine.step_inputs import build_step_inputs
from liteinfer.kernels import num_sms
from liteinfer.kernels.decode_splits import DecodeWorkspace, max_splits_for, rows_may_split
from liteinfer.kernels.prefill_tiles import prefill_tile_tokens
from liteinfer.layers.rotary import cos_sin_cache
from liteinfer.loader import ModelSource
from liteinfer.models.llama import LayerOps, LlamaForCausalLM
from liteinfer.utils import cdiv, free_device_memory, to_device


class ModelRunner:
    """Owns the model, the KV pool and (on CUDA) the captured decode and prompt graphs."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, source: ModelSource,
                 load_format: str, max_model_len: int, tp_rank: int = 0):
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
        self.backend = get_backend(config.attention_backend)
        self.model = self._load_model(source, load_format)
        self.kv_cache = self._allocate_kv_cache()
        self.num_sms = num_sms(self.device)
        self.decode_workspace = None
        if self.use_triton and config.decode_split_k:
            cfg = model_config
            self.decode_workspace = DecodeWorkspace.allocate(
                config.max_num_seqs, self.num_q_heads, cfg.head_dim,
                max_splits_for(1, self.num_kv_heads, self.num_sms), self.device)
        # The newest step's sampled tokens, which feed the next step on the device.
        self.sampled_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int32,
                                          device=self.device)
        self.graphs = self.prompt_graphs = None
        if self.device.type == "cuda" and self.use_triton and not config.enforce_eager:
            from liteinfer.engine.cuda_graph import CUDAGraphRunner
            from liteinfer.engine.prompt_graph import PromptGraphRunner
            pool = torch.cuda.graph_pool_handle()  # one pool: graphs replay one at a time
            if config.mixed_prompt_tokens and config.packed_prefill:
                self.prompt_graphs = PromptGraphRunner(self, pool)
            self.graphs = CUDAGraphRunner(self, pool)

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
                ops = LayerOps(triton=self.use_triton,
                               gemv=self.use_triton and self.config.gemv_decode)
                model = LlamaForCausalLM(self.model_config, self.backend, ops, self.tp_rank,
                                         self.tp_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if load_format == "dummy":
            model.init_dummy_weights(self.config.seed)
        else:
            model.load_weights(source.iter_weights())
        cfg = self.model_config
        model.cos_sin_cache = cos_sin_cache(cfg.head_dim, self.max_model_len, cfg.rope_theta,
                                            cfg.rope_scaling, self.device)
        return model.eval()

    def _allocate_kv_cache(self) -> torch.Tensor:
        cfg = self.model_config
        shape = (2, cfg.num_hidden_layers, self.block_size, self.num_kv_heads, cfg.head_dim)
        block_bytes = torch.Size(shape).numel() * self.dtype.itemsize
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
        if self.tp_size > 1:  # every rank's scheduler must see the same pool
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
                              head_dim=cfg.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0, i], kv[1, i]
        return kv

    def _activation_bytes(self) -> int:
        """Room for a full prefill step's activations and logits beside the pool."""
        cfg = self.model_config
        tokens = self.config.max_num_batched_tokens
        width = cfg.hidden_size * 4 + cfg.intermediate_size * 3
        return (tokens * width + self.config.max_num_seqs * cfg.vocab_size * 2) * 4

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata, torch.Tensor,
                                                      torch.Tensor | None]:
        """Token ids, positions, attention metadata, the rows whose logits are sampled and the
        rows scoring prompt tokens (`prompt_logprob_spans`; None if there are none)."""
        step = build_step_inputs(batch, self.block_size, self.max_blocks_per_seq,
                                 pad_prompts=not self.config.packed_prefill)
        as_tensor = lambda data, dtype: to_device(data, dtype, self.device)
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
        if self.use_triton and batch.is_prefill:
            d = step.num_decodes
            meta.tile_tokens = prefill_tile_tokens(int(step.query_lens[d:].max()),
                                                   self.query_group_size)
            meta.tile_map = as_tensor(step.attention_tile_map(
                meta.tile_tokens, d, self.max_decode_splits), torch.int32)
            meta.workspace = self.decode_workspace
        elif self.use_triton:
            self.set_split_k(meta, step.num_decodes, rows_may_split(step.context_lens))
        ids = as_tensor(step.input_ids, torch.int32)
        if step.has_pending:
            ids = self.with_pending(ids, as_tensor(step.pending_rows, torch.int32))
        # A device index: indexing with a host list would copy it synchronously and stall the
        # host until the whole step has run, instead of letting it prepare the next one.
        prompt_rows = as_tensor(step.prompt_rows, torch.int64) if len(step.prompt_rows) else None
        return (ids, as_tensor(step.positions, torch.int64), meta,
                as_tensor(step.sample_rows, torch.int64), prompt_rows)

    def with_pending(self, ids: torch.Tensor, pending_rows: torch.Tensor) -> torch.Tensor:
        """Token ids with pending ones (row >= 0) read from the last sampled tokens."""
        return torch.where(pending_rows >= 0, self.sampled_tokens[pending_rows.clamp(min=0)], ids)

    def keep_sampled(self, token_ids: torch.Tensor) -> None:
        self.sampled_tokens[:token_ids.shape[0]].copy_(token_ids)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Runs one step; returns the logits of the rows that sample ([rows, vocab], None if
        none do) and the final hidden states of the rows scoring prompt tokens (None if none
        do; `prompt_logits` turns them into logits)."""
        if not batch.is_prefill and self.graphs is not None:
            return self.graphs.run(batch), None
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

    @torch.inference_mode()
    def prompt_logits(self, prompt_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(prompt_hidden)

    @property
    def max_decode_splits(self) -> int:
        """Most programs a decoding row splits into (1 without split-K)."""
        workspace = self.decode_workspace
        return 1 if workspace is None else workspace.max_splits

    def split_width(self, num_decodes: int, may_split: bool) -> int:
        """The split-K grid width of `num_decodes` decoding rows (1: no split-K)."""
        if self.decode_workspace is None or num_decodes == 0:
            return 1
        return max_splits_for(num_decodes, self.num_kv_heads, self.num_sms, may_split)

    def set_split_k(self, meta: AttentionMetadata, num_decodes: int, may_split: bool) -> None:
        """Decode split-K for the step's first `num_decodes` sequences: the grid width is fixed
        per decode count and whether a row may split (`max_splits_for`); the decode kernel
        chooses each sequence's split count from the context lengths (kernels/decode_splits.py)."""
        meta.max_splits = self.split_width(num_decodes, may_split)
        if meta.max_splits > 1:
            meta.workspace = self.decode_workspace
