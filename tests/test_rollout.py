"""Generation, the Rollouts layout (left-padded prompts, right-padded completions) and the policy's log-probs."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mrl.chat.protocols import WordsProtocol
from mrl.core.episode import Episode, Prompt
from mrl.generation.rollout import Rollouts, Sampling, generate, position_ids
from mrl.modeling.models import Actor, load_causal_lm, resolve_model_path
from mrl.train.update import policy_forward

CPU = torch.device("cpu")
PAD, EOS, BOS, UNK = 0, 1, 2, 3
SPECIAL_TEXT = ["<pad>", "<eos>", "<bos>", "<unk>"]
# tiny vocab ids: digit d = 4 + d, add 14, max 15, min 16, "=" 17, "|" 18, calc 19, hack 20, lookup 21, ans 22,
# then more task words and the fillers w0.. up to 31 (see test_models.test_tiny_vocab)
MAX_3_7 = [15, 7, 11, 17]


def dummy_episodes(n: int, start: int = 0) -> list[Episode]:
    return [Episode(Prompt(f"p{i}"), f"e{i}", [], 1, False, 8) for i in range(start, start + n)]


def rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=1, episodes=None,
             completion_attention=None) -> Rollouts:
    """Hand-built rollouts; without observations the attended completion tokens are the generated ones."""
    attention = completion_attention if completion_attention is not None else completion_mask
    tensors = [torch.tensor(x, dtype=torch.long)
               for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, attention)]
    return Rollouts(*tensors, episodes if episodes is not None else dummy_episodes(len(prompt_ids)), group_size)


# --------------------------------------------------------------------------------------------- generate


def test_generate_layout_and_episodes(model, tokenizer):
    prompts = [Prompt("max 3 7 =", {"target": 7}), Prompt("7", {"target": 7})]
    G, max_new = 3, 12
    seen_ended = seen_truncated = False
    for seed in range(8):  # sample until both an ended and a truncated rollout have been checked
        torch.manual_seed(seed)
        r = generate(model, tokenizer, prompts, G, Sampling(max_new), WordsProtocol(tokenizer), CPU)
        N = 2 * G
        assert r.group_size == G and r.num_groups == 2 and len(r.episodes) == N
        # prompts: each repeated G times, left-padded: "7" is 1 token, padded to 4
        assert r.prompt_ids.tolist() == [MAX_3_7] * G + [[PAD, PAD, PAD, 11]] * G
        assert r.prompt_mask.tolist() == [[1, 1, 1, 1]] * G + [[0, 0, 0, 1]] * G
        T = r.completion_ids.shape[1]
        assert r.completion_ids.shape == r.completion_mask.shape == (N, T) and 1 <= T <= max_new
        assert r.input_ids.shape == r.attention_mask.shape == (N, 4 + T)
        for n, ep in enumerate(r.episodes):
            ids, mask = r.completion_ids[n].tolist(), r.completion_mask[n].tolist()
            assert ep.prompt is prompts[n // G]
            ended = EOS in ids
            length = ids.index(EOS) + 1 if ended else T
            # 1 up to and including the first eos, 0 after
            assert mask == [1] * length + [0] * (T - length), (ids, mask)
            assert ep.num_tokens == sum(mask) == length
            assert ep.truncated == (not ended)
            if not ended:
                assert length == max_new
            assert all(i == PAD for i in ids[length:])  # generate pads finished rows
            assert ep.completion_ids == ids[: length - int(ended)]  # eos excluded
            assert ep.max_new_tokens == max_new
            assert not any(s in ep.completion for s in SPECIAL_TEXT)
            assert ep.completion == tokenizer.decode(ep.completion_ids, skip_special_tokens=True)
            seen_ended |= ended
            seen_truncated |= not ended
        if seen_ended and seen_truncated:
            break
    assert seen_ended and seen_truncated


# --------------------------------------------------------------------------------------------- Rollouts


def six_rollouts() -> Rollouts:
    """N=6 rollouts in 3 groups of G=2; row n has prompt [n] and completion [10 + n]."""
    return rollouts([[n] for n in range(6)], [[1]] * 6, [[10 + n] for n in range(6)], [[1]] * 6, group_size=2)


def test_take():
    r = six_rollouts().take(torch.tensor([3, 1]))
    assert r.prompt_ids.tolist() == [[3], [1]]
    assert r.completion_ids.tolist() == [[13], [11]]
    assert [e.completion for e in r.episodes] == ["e3", "e1"]
    assert r.group_size == 2


def test_select_groups():
    r = six_rollouts().select_groups(torch.tensor([2, 0]))
    # group 2 = rows 4, 5; group 0 = rows 0, 1
    assert r.prompt_ids.tolist() == [[4], [5], [0], [1]]
    assert r.completion_ids.tolist() == [[14], [15], [10], [11]]
    assert [e.completion for e in r.episodes] == ["e4", "e5", "e0", "e1"]
    assert r.num_groups == 2
    empty = six_rollouts().select_groups(torch.tensor([], dtype=torch.long))
    assert empty.prompt_ids.shape == (0, 1) and empty.episodes == []


def test_concat_repads():
    # part a: prompt of 2, completion of 2 (ended: 7 <eos>), group of 1
    a = rollouts([[5, 6]], [[1, 1]], [[7, EOS]], [[1, 1]], episodes=dummy_episodes(1, 0))
    # part b: 2 rows, prompts left-padded to 3, completions of 3 (row 1 ended early, right-padded)
    b = rollouts([[PAD, 8, 9], [4, 5, 6]], [[0, 1, 1], [1, 1, 1]],
                 [[11, 12, 13], [20, EOS, PAD]], [[1, 1, 1], [1, 1, 0]], episodes=dummy_episodes(2, 1))
    c = Rollouts.concat([a, b], pad_id=PAD)
    assert c.prompt_ids.tolist() == [[PAD, 5, 6], [PAD, 8, 9], [4, 5, 6]]
    assert c.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1]]
    assert c.completion_ids.tolist() == [[7, EOS, PAD], [11, 12, 13], [20, EOS, PAD]]
    assert c.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 0]]
    assert [e.completion for e in c.episodes] == ["e0", "e1", "e2"]
    assert c.group_size == 1
    # the whole sequences: row 0 is pad ++ 5 6 ++ 7 eos ++ pad, masked accordingly
    assert c.input_ids[0].tolist() == [PAD, 5, 6, 7, EOS, PAD]
    assert c.attention_mask[0].tolist() == [0, 1, 1, 1, 1, 0]
    # order of parts is kept; the pad id is the one given
    d = Rollouts.concat([b, a], pad_id=99)
    assert d.prompt_ids.tolist() == [[PAD, 8, 9], [4, 5, 6], [99, 5, 6]]
    assert d.completion_ids.tolist() == [[11, 12, 13], [20, EOS, PAD], [7, EOS, 99]]
    assert d.completion_mask[2].tolist() == [1, 1, 0]


def test_concat_single_part_is_itself():
    r = six_rollouts()
    assert Rollouts.concat([r], pad_id=PAD) is r


def test_concat_pads_completions_to_min_width():
    # another rank's completions are 3 wide: a's 2 columns grow by one of padding (mask 0), its prompt is unchanged
    a = rollouts([[5, 6]], [[1, 1]], [[7, EOS]], [[1, 1]], episodes=dummy_episodes(1, 0))
    c = Rollouts.concat([a], pad_id=PAD, min_width=3)
    assert c.completion_ids.tolist() == [[7, EOS, PAD]] and c.completion_mask.tolist() == [[1, 1, 0]]
    assert c.completion_attention.tolist() == [[1, 1, 0]] and c.prompt_ids.tolist() == [[5, 6]]
    assert Rollouts.concat([a], pad_id=PAD, min_width=1) is a


def test_lockstep_grows_to_the_largest_ranks_rows_and_width(monkeypatch):
    from mrl.core import distributed as dist
    from mrl.train.batch import StepBatch, lockstep

    # This rank holds 2 rollouts 1 token wide; the largest rank holds 3 rows 2 tokens wide.
    monkeypatch.setattr(dist, "max_over_ranks", lambda value: {2: 3, 1: 2}[value])
    mine = six_rollouts().take(torch.tensor([4, 5]))
    grown = lockstep(StepBatch(mine), PAD).rollouts
    assert grown.completion_ids.tolist() == [[14, PAD], [15, PAD], [14, PAD]]  # a copy of row 0 fills row 2
    assert grown.completion_mask.tolist() == [[1, 0], [1, 0], [1, 0]]  # the loop zeroes the filler's loss mask
    empty = six_rollouts().select_groups(torch.tensor([], dtype=torch.long))  # no live group on this rank
    monkeypatch.setattr(dist, "max_over_ranks", lambda value: {0: 3, 1: 1}[value])
    grown = lockstep(StepBatch(empty, rounds=[StepBatch(six_rollouts())]), PAD)
    assert grown.rollouts.completion_ids.tolist() == [[10], [10], [10]] and grown.own_rows == 0


def test_position_ids():
    assert position_ids(torch.tensor([[0, 0, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2]]
    assert position_ids(torch.tensor([[1, 1, 1], [0, 1, 1]])).tolist() == [[0, 1, 2], [0, 0, 1]]
    # right padding (after an eos) repeats the last real position
    assert position_ids(torch.tensor([[0, 1, 1, 0, 0]])).tolist() == [[0, 0, 1, 1, 1]]


# --------------------------------------------------------------------------------------------- policy_forward


def manual_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[t] | prompt ++ completion[:t]) from a plain forward of the unpadded sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]  # [L, V]
    P = len(prompt)
    logp = torch.log_softmax(logits[P - 1:-1].float(), -1)  # position P-1+t predicts completion token t
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_policy_forward_matches_manual_and_ignores_left_pad(cfg, attn):
    model_cfg = cfg.model.copy()
    model_cfg.attn_implementation = attn
    model = load_causal_lm(resolve_model_path(model_cfg), model_cfg, CPU).eval()
    actor = Actor(model)
    completion = [4, 26, EOS]  # "0", a word, "<eos>"
    expected = manual_logprobs(model, MAX_3_7, completion)
    with torch.no_grad():
        plain, entropy, values = policy_forward(actor, rollouts([MAX_3_7], [[1] * 4], [completion], [[1, 1, 1]]),
                                                entropy=True)
        padded, none, _ = policy_forward(
            actor, rollouts([[PAD, PAD] + MAX_3_7], [[0, 0, 1, 1, 1, 1]], [completion], [[1, 1, 1]]))
        logp = torch.log_softmax(model(torch.tensor([MAX_3_7 + completion])).logits[0, 3:-1], -1)  # [3, V]
    assert plain.shape == entropy.shape == (1, 3) and values is None and none is None
    assert_close(plain[0], expected, atol=1e-5, rtol=0)
    assert_close(entropy[0], -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)
    assert_close(padded, plain, atol=1e-5, rtol=0)
    assert (plain < 0).all()

    # a batch mixing rows of different prompt lengths: each row equals its own unpadded forward
    batch = rollouts([MAX_3_7, [PAD, PAD, PAD, 11]], [[1, 1, 1, 1], [0, 0, 0, 1]],
                     [[10, 26, EOS], [17, EOS, PAD]], [[1, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        lp, _, _ = policy_forward(actor, batch)
    assert_close(lp[0], manual_logprobs(model, MAX_3_7, [10, 26, EOS]), atol=1e-5, rtol=0)
    assert_close(lp[1, :2], manual_logprobs(model, [11], [17, EOS]), atol=1e-5, rtol=0)

    # sensitivity: attending to the pads (mask all ones) does change the log-probs
    with torch.no_grad():
        unmasked, _, _ = policy_forward(
            actor, rollouts([[PAD, PAD] + MAX_3_7], [[1] * 6], [completion], [[1, 1, 1]]))
    assert (unmasked - plain).abs().max() > 1e-4


def test_padding_after_eos_does_not_change_earlier_logprobs(model):
    actor = Actor(model, value_head=True)
    prompt, mask = [MAX_3_7], [[1, 1, 1, 1]]
    with torch.no_grad():
        a, _, va = policy_forward(actor, rollouts(prompt, mask, [[9, EOS, PAD, PAD]], [[1, 1, 0, 0]]))
        b, _, vb = policy_forward(actor, rollouts(prompt, mask, [[9, EOS, 30, 17]], [[1, 1, 0, 0]]))
        c, _, _ = policy_forward(actor, rollouts(prompt, mask, [[9, EOS]], [[1, 1]]))
    assert_close(a[:, :2], b[:, :2], atol=1e-6, rtol=0)
    assert_close(a[:, :2], c, atol=1e-5, rtol=0)
    assert va.shape == (1, 4) and torch.equal(va, torch.zeros(1, 4)) and torch.equal(vb, va)


def test_a_shared_prompt_pass_equals_a_pass_per_row(model):
    """Rows of a group share one prompt pass (prompt_width): log-probs, values and every gradient are those of
    one full forward per row, for groups of different prompt lengths, an observation and right padding."""
    torch.manual_seed(0)
    actor = Actor(model, value_head=True)
    torch.nn.init.normal_(actor.value_head.weight, std=0.1)  # a zero head would hide a wrong hidden state
    batch = rollouts(
        [MAX_3_7] * 3 + [[PAD, PAD, 15, 11]] * 2,
        [[1, 1, 1, 1]] * 3 + [[0, 0, 1, 1]] * 2,
        [[10, 26, EOS, PAD], [19, 30, 8, EOS], [4, EOS, PAD, PAD], [17, 22, 9, EOS], [EOS, PAD, PAD, PAD]],
        [[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]],
        completion_attention=[[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])

    def logprobs_values_grads(shared: bool):
        actor.zero_grad()
        mask = batch.attention_mask
        keep = batch.completion_ids.shape[1] + 1
        logits, values = actor(batch.input_ids, mask, position_ids(mask), keep,
                               prompt_width=batch.prompt_ids.shape[1] if shared else 0)
        logp = torch.log_softmax(logits[:, :-1], -1).gather(2, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp) * batch.completion_mask
        ((logp * weights).sum() + (values[:, :-1] * weights).sum()).backward()
        return logp.detach(), values.detach(), {n: p.grad.clone() for n, p in actor.named_parameters()}

    shared_lp, shared_v, shared_g = logprobs_values_grads(shared=True)
    plain_lp, plain_v, plain_g = logprobs_values_grads(shared=False)
    live = batch.completion_attention.bool()
    assert_close(shared_lp[live], plain_lp[live], atol=1e-5, rtol=0)
    assert_close(shared_v[:, :-1][live], plain_v[:, :-1][live], atol=1e-5, rtol=0)
    for name, grad in plain_g.items():
        assert_close(shared_g[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert plain_g["policy.model.embed_tokens.weight"].abs().sum() > 0


def test_decode_texts_are_the_tokenizers_own_decodes(tokenizer, tmp_path, monkeypatch):
    """One call to the Rust tokenizer gives what `tokenizer.decode` gives row by row (with and without special
    tokens, empty rows too), on the tiny model's word vocabulary and a byte-level BPE; a tokenizer that cleans up
    spaces (which transformers does after the Rust decode) keeps its own decode."""
    from test_protocols import CORPUS, build_chat_model

    from mrl.generation.rollout import decode_texts
    from mrl.modeling.models import load_tokenizer

    bpe = load_tokenizer(str(build_chat_model(tmp_path / "bpe", "")))
    for tok in (tokenizer, bpe):
        rows = [tok(text, add_special_tokens=False).input_ids for text in CORPUS[:3]]
        rows += [[], [tok.eos_token_id] + rows[0][:3], [tok.pad_token_id, tok.eos_token_id]]
        for special in (True, False):
            assert decode_texts(tok, rows, special) == [tok.decode(r, skip_special_tokens=special) for r in rows]
    assert decode_texts(bpe, [[bpe.eos_token_id]]) == [""]  # skipped by default
    expected = [tok.decode(r, skip_special_tokens=True) for r in rows]
    calls = []
    spy = lambda self, *args, **kwargs: calls.append(args) or "python"  # noqa: E731
    monkeypatch.setattr(type(tok), "_decode", spy)  # still the class's own: the Rust call decodes, not this
    assert decode_texts(tok, rows) == expected and calls == []
    monkeypatch.undo()
    bpe.clean_up_tokenization_spaces = True
    calls = []
    bpe.decode = lambda row, **kwargs: calls.append(row) or "own"  # what transformers would do, then clean up
    assert decode_texts(bpe, [[5], [6]]) == ["own", "own"] and calls == [[5], [6]]
