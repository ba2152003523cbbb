"""Turns a scheduled batch into tensors, runs the model and returns the logits to sample from."""
from __future__ import annotations

import numpy as np
import torch

from liteinfer.attention import AttentionMetadata, get_backend
from liteinfer.config import EngineConfig, ModelConfig
from liteinfer.engine.scheduler import ScheduledBatch
from liteinfer.kernels.decode_splits import DecodeWorkspace, choose_num_splits, max_splits_for
from liteinfer.layers.rotary import cos_sin_cache
from liteinfer.loader import ModelSource
from liteinfer.models.llama import LayerOps, LlamaForCausalLM
from liteinfer.utils import cdiv, to_device


class ModelRunner:
    """Owns the model, the KV pool and (on CUDA) the captured decode graphs."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, source: ModelSource,
                 load_format: str, max_model_len: int):
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype: torch.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.use_triton = config.attention_backend == "triton"
        self.backend = get_backend(config.attention_backend)
        self.model = self._load_model(source, load_format)
        self.kv_cache = self._allocate_kv_cache()
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 8)
        self.decode_workspace = None
        if self.use_triton and config.decode_split_k:
            cfg = model_config
            self.decode_workspace = DecodeWorkspace.allocate(
                config.max_num_seqs, cfg.num_attention_heads, cfg.head_dim,
                max_splits_for(1, cfg.num_key_value_heads, self.num_sms), self.device)
        # The newest step's sampled tokens, which feed the next step on the device.
        self.sampled_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int32,
                                          device=self.device)
        self.graphs = None
        if self.device.type == "cuda" and self.use_triton and not config.enforce_eager:
            from liteinfer.engine.cuda_graph import CUDAGraphRunner
            self.graphs = CUDAGraphRunner(self)

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
                model = LlamaForCausalLM(self.model_config, self.backend, ops)
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
        shape = (2, cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
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
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(f"KV pool of {num_blocks} blocks cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}; lower max_model_len or give "
                             f"the pool more memory")
        self.num_kv_blocks = num_blocks
        kv = torch.zeros(2, cfg.num_hidden_layers, num_blocks, self.block_size,
                         cfg.num_key_value_heads, cfg.head_dim, dtype=self.dtype,
                         device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0, i], kv[1, i]
        return kv

    def _activation_bytes(self) -> int:
        """Room for a full prefill step's activations and logits beside the pool."""
        cfg = self.model_config
        tokens = self.config.max_num_batched_tokens
        width = cfg.hidden_size * 4 + cfg.intermediate_size * 3
        return (tokens * width + self.config.max_num_seqs * cfg.vocab_size * 2) * 4

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Token ids, positions, attention metadata and the rows whose logits are sampled.

        Positions and KV slots are computed for all tokens at once with numpy: a 16k-token
        prefill would otherwise spend milliseconds of host time in per-token Python loops."""
        block, seqs = self.block_size, batch.seqs
        num_tokens = np.array(batch.num_tokens)
        starts = np.array([seq.num_computed_tokens for seq in seqs])
        # Padded prefill right-pads each chunk to the longest; packed prefill and decode do not.
        pad_to = num_tokens.max() if batch.is_prefill and not self.config.packed_prefill else 0
        query_lens = np.maximum(num_tokens, pad_to)
        cu_seqlens = np.concatenate([[0], np.cumsum(query_lens)])
        context_lens = starts + query_lens
        input_ids: list[int] = []
        pending_rows: list[int] = []  # per token: row in sampled_tokens, or -1
        for seq, n, q_len in zip(seqs, batch.num_tokens, query_lens.tolist()):
            if seq.num_pending:  # decoding a token the host has not seen yet
                assert n == 1 and seq.num_computed_tokens == len(seq.token_ids), \
                    "pending tokens are decoded alone"
                input_ids.append(0)
                pending_rows.append(seq.pending_row)
            else:
                start = seq.num_computed_tokens
                input_ids += seq.token_ids[start:start + n]
                pending_rows += [-1] * n
            input_ids += [0] * (q_len - n)
            pending_rows += [-1] * (q_len - n)
        width = cdiv(int(context_lens.max()), block)
        tables = np.zeros((len(seqs), width), dtype=np.int64)
        for row, seq in zip(tables, seqs):
            table = seq.block_table[:width]
            row[:len(table)] = table
        seq_of = np.repeat(np.arange(len(seqs)), query_lens)
        offset = np.arange(cu_seqlens[-1]) - cu_seqlens[seq_of]
        real = offset < num_tokens[seq_of]
        # Padding tokens repeat the last position (past it the RoPE table may end) and are
        # written nowhere (slot -1).
        positions = starts[seq_of] + np.minimum(offset, num_tokens[seq_of] - 1)
        slots = np.where(real, tables[seq_of, positions // block] * block + positions % block, -1)
        sample_rows = [int(cu_seqlens[i]) + n - 1 for i, n in enumerate(batch.num_tokens)
                       if batch.samples(i)]
        as_tensor = lambda data, dtype: to_device(data, dtype, self.device)
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=as_tensor(slots, torch.int64),
            context_lens=as_tensor(context_lens, torch.int32),
            block_tables=as_tensor(tables, torch.int32),
            cu_seqlens_q=as_tensor(cu_seqlens, torch.int32) if batch.is_prefill else None,
            max_seqlen_q=int(query_lens.max()),
            query_lens_host=query_lens.tolist(),
            context_lens_host=context_lens.tolist(),
        )
        ids = as_tensor(input_ids, torch.int32)
        if any(seq.num_pending for seq in seqs):
            ids = self.with_pending(ids, as_tensor(pending_rows, torch.int32))
        return ids, as_tensor(positions, torch.int64), meta, sample_rows

    def with_pending(self, ids: torch.Tensor, pending_rows: torch.Tensor) -> torch.Tensor:
        """Token ids with pending ones (row >= 0) read from the last sampled tokens."""
        return torch.where(pending_rows >= 0, self.sampled_tokens[pending_rows.clamp(min=0)], ids)

    def keep_sampled(self, token_ids: torch.Tensor) -> None:
        self.sampled_tokens[:token_ids.shape[0]].copy_(token_ids)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Runs one step; returns logits [rows that sample, vocab], or None if none do."""
        if not batch.is_prefill and self.graphs is not None:
            return self.graphs.run(batch)
        input_ids, positions, meta, rows = self.prepare(batch)
        if not batch.is_prefill and self.use_triton:
            self.set_split_k(meta, len(batch.seqs))
        hidden = self.model(input_ids, positions, meta)
        if not rows:
            return None
        # A device index: indexing with a host list would copy it synchronously and stall the
        # host until the whole step has run, instead of letting it prepare the next one.
        return self.model.compute_logits(hidden[to_device(rows, torch.int64, self.device)])

    def set_split_k(self, meta: AttentionMetadata, batch_size: int) -> None:
        """Decode split-K: the grid width is fixed per batch size, the split count per sequence
        is chosen on the device from its context length."""
        if self.decode_workspace is None:
            return
        meta.max_splits = max_splits_for(batch_size, self.model_config.num_key_value_heads,
                                         self.num_sms)
        if meta.max_splits > 1:
            meta.num_splits = choose_num_splits(meta.context_lens, meta.max_splits)
            meta.workspace = self.decode_workspace
