"""EAGLE-3 drafting (`method: eagle3`): a tiny random head written in the published checkpoint
layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: `fc`, one `midlayer` reading 2H, `norm`, a
draft-vocabulary `lm_head` with `d2t`/`t2d`) loads and drafts, and greedy output equals plain
greedy token for token, whatever its (random) drafts are; bad heads are clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fixtures import TINY_LLAMA, build_llm
from reference import random_prompts
from test_draft_model import replay_captures_eagerly
from test_spec_decode import ENGINE, greedy, release, spec_stats, token_ids

DRAFT_VOCAB = 256


def write_eagle3_head(directory: Path, aux_layers: list[int] | None = (0, 1, 1),
                      drop: str | None = None, hidden_size: int = TINY_LLAMA["hidden_size"],
                      max_position_embeddings: int = TINY_LLAMA["max_position_embeddings"]
                      ) -> Path:
    """A random EAGLE-3 head for the tiny Llama (TINY_LLAMA's attention and MLP shapes), its
    draft vocabulary a random subset of the target's. `aux_layers`: the config's
    eagle_aux_hidden_state_layer_ids (None: left out); `drop`: a tensor left out."""
    directory.mkdir(parents=True)
    h, inter = hidden_size, TINY_LLAMA["intermediate_size"]
    heads, kv = TINY_LLAMA["num_attention_heads"], TINY_LLAMA["num_key_value_heads"]
    vocab, head_dim = TINY_LLAMA["vocab_size"], hidden_size // heads
    g = torch.Generator().manual_seed(3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    kept = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors = {
        "fc.weight": rand(h, 3 * h), "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(DRAFT_VOCAB, h), "d2t": kept - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
        "midlayer.hidden_norm.weight": 1 + rand(h), "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter)}
    tensors.pop(drop, None)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
              "draft_vocab_size": DRAFT_VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": max_position_embeddings}
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def eagle3_config(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def test_greedy_equals_plain_decoding(tiny_llm, tiny_llama_dir, tmp_path):
    """Batched prompts chunked over small steps, the second run from the prefix cache: the
    same tokens as without speculation, with the head's drafts verified (a random head's are
    rejected, but they are drafted from its map into the target's vocabulary)."""
    head = write_eagle3_head(tmp_path / "head")
    prefix = random_prompts(1, 384, 40, 40, seed=31)[0]
    prompts = [prefix + t for t in random_prompts(3, 384, 3, 20, seed=32)] + random_prompts(
        3, 384, 3, 60, seed=33)
    ref = token_ids(tiny_llm.generate(prompts, greedy(), use_tqdm=False))
    llm = build_llm(str(tiny_llama_dir), **ENGINE, max_num_batched_tokens=32, max_num_seqs=4,
                    speculative_config=eagle3_config(head))
    try:
        for _ in range(2):
            assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == ref
        assert llm.engine.core.block_manager.prefix_hits > 0
        assert spec_stats(llm).num_draft_tokens > 0
        drafter = llm.engine.core.runner.drafter
        kept = set((torch.arange(DRAFT_VOCAB) + drafter.model.d2t.cpu()).tolist())
        assert len(kept) == DRAFT_VOCAB and kept != set(range(DRAFT_VOCAB))
    finally:
        release(llm)


def test_bad_heads_are_clear_errors(tiny_llama_dir, tmp_path):
    for head, match in (
            (write_eagle3_head(tmp_path / "a", drop="midlayer.hidden_norm.weight"), "lacks"),
            # vLLM's default layers (2, 1, -1) do not exist in a 2-layer target.
            (write_eagle3_head(tmp_path / "b", aux_layers=None), "layers"),
            (write_eagle3_head(tmp_path / "c", hidden_size=32), "hidden size")):
        with pytest.raises(ValueError, match=match):
            build_llm(str(tiny_llama_dir), **ENGINE, speculative_config=eagle3_config(head))


class ProposalLog:
    """Every drafting model's proposal, by the token ids it follows, under the current run's
    key (`run`: graphs off or on), to compare the drafts two runs make after the same tokens."""

    def __init__(self, monkeypatch):
        from liteinfer.spec_decode.model_drafts import ModelDraftsProposer

        self.run = False
        self.by_run: dict[bool, dict[tuple[int, ...], list[int]]] = {False: {}, True: {}}
        propose = ModelDraftsProposer.propose

        def recorded(proposer, request_id, prompt_len, token_ids, max_tokens):
            drafts = propose(proposer, request_id, prompt_len, token_ids, max_tokens)
            if drafts:
                self.by_run[self.run][tuple(token_ids)] = drafts
            return drafts

        monkeypatch.setattr(ModelDraftsProposer, "propose", recorded)


# A captured prompt step's padding tokens (no query tile maps them) take whatever memory the
# attention output held, which may overflow in the interpreted kernels; no real row reads them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_head_reads_the_targets_captured_steps(tiny_llm, tiny_llama_dir, tmp_path, monkeypatch):
    """The target's steps as its captured graphs run them, replayed on the CPU with the Triton
    kernels (`replay_captures_eagerly`): three sequences decode beside a long prompt's chunks
    and then its verifications, in steps whose decoding rows are padded to four, so the
    hidden states the head reads sit past the padding. The head proposes the same drafts
    after each of the long prompt's lengths as with every step eager, and the tokens are
    plain decoding's."""
    from liteinfer.engine.prompt_graph import capture_step_graphs

    replays = replay_captures_eagerly(monkeypatch)
    log = ProposalLog(monkeypatch)
    proposed = log.by_run
    head = write_eagle3_head(tmp_path / "head")
    prompts = random_prompts(3, 384, 4, 10, seed=41) + random_prompts(1, 384, 40, 40, seed=42)
    # The short prompts draft nothing before min_tokens: they decode beside the long one.
    params = [greedy(16, min_tokens=16)] * 3 + [greedy(12)]
    ref = token_ids(tiny_llm.generate(prompts, params, use_tqdm=False))
    padded = []
    for captured in (False, True):
        log.run = captured
        llm = build_llm(str(tiny_llama_dir), **ENGINE, attention_backend="triton",
                        max_num_seqs=4, max_num_batched_tokens=32, mixed_prompt_tokens=16,
                        speculative_config=eagle3_config(head))
        try:
            # A random head's drafts are rejected: hold the acceptance the draft length
            # follows at 1 (as `liteinfer-bench spec` does), so that every step drafts.
            policy = llm.engine.core.scheduler.speculator.policy
            policy.mean_accepted = policy.mean_trials = 1.0
            policy.record = lambda *_: None
            runner = llm.engine.core.runner
            if captured:
                runner.graphs, runner.prompt_graphs = capture_step_graphs(
                    runner.step_model, runner.config, None)
                runner.drafter.capture_graphs(None)
                replays.clear()
                runner.drafter.decode_rows = lambda b, rows=runner.drafter.decode_rows: (
                    padded.append((b.num_decodes, rows(b))) or padded[-1][1])
                # (shutting the engine down frees its graphs)
                prompt_graphs = set(map(id, runner.prompt_graphs.graphs.values()))
                proposal_graphs = {id(g) for g, _ in
                                   runner.drafter.proposals.graphs.graphs.values()}
            assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == ref
        finally:
            release(llm)
    assert any(d < rows for d, rows in padded)  # decoding rows were padded
    replayed = {id(r) for r in replays}
    assert replayed & prompt_graphs
    assert replayed & proposal_graphs
    both = proposed[False].keys() & proposed[True].keys()
    assert len(both) >= 8
    for key in both:
        eager, graphs = proposed[False][key], proposed[True][key]
        n = min(len(eager), len(graphs))  # the room for drafts may differ
        assert eager[:n] == graphs[:n]
