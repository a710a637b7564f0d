"""Multi-turn rollouts with tools: the transcript layout generate() builds, and what the loss sees of it.

A tool's observation is part of the transcript (the policy reads it in its later turns) but never trained on:
completion_mask is 0 on it, as on padding.
"""

from __future__ import annotations

import pytest
import torch

from mrl.algo.losses import aggregate, clipped_surrogate
from mrl.chat.protocols import Tool, WordsProtocol
from mrl.core.episode import Episode, Prompt, ToolCall
from mrl.envs.agent_triple import AgentTriple, Correctness, Efficiency, Safety, read_answer
from mrl.generation.rollout import (
    SHARED_PREFIX_MIN,
    Rollouts,
    Sampling,
    end_token_ids,
    generate,
    position_ids,
    prompt_cache,
    prompt_layout,
    shared_prefix_length,
)
from mrl.modeling.models import Actor, load_causal_lm, resolve_model_path
from mrl.train.update import policy_forward

CPU = torch.device("cpu")
PAD, EOS = 0, 1
DIGIT_IDS = set(range(4, 14))  # tiny vocab: digit d is 4 + d
ADD_3_4 = [14, 7, 8, 17]  # "add 3 4 =" (add 14, "=" 17)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# --------------------------------------------------------------------------------------------- generate


def check_episode(r: Rollouts, n: int, tokenizer, model, tools: dict, answer_words: tuple[str, ...],
                  max_new: int, max_turns: int) -> Episode:
    """Every invariant of a generated episode n, worked out from its tokens alone."""
    ep = r.episodes[n]
    ids, mask = r.completion_ids[n].tolist(), r.completion_mask[n].tolist()
    T = len(ids)
    end_ids = set(end_token_ids(model, tokenizer))
    tool_ids = {encode(tokenizer, name)[0]: name for name in tools}
    answer_ids = {encode(tokenizer, w)[0] for w in answer_words}
    length = ep.num_tokens + ep.observation_tokens  # the transcript; padding after it
    assert 1 <= ep.num_tokens <= max_new and length <= T
    assert ids[length:] == [PAD] * (T - length) and mask[length:] == [0] * (T - length)

    # Walk the transcript: a tool-name token is followed by exactly its observation's tokens, masked 0.
    expected_mask, turn_tokens, current, k, t = [], [], [], 0, 0
    while t < length:
        token = ids[t]
        if token in tool_ids:
            call = ep.tool_calls[k]
            assert call.name == tool_ids[token]
            observed = encode(tokenizer, call.observation)
            assert ids[t + 1:t + 1 + len(observed)] == observed
            expected_mask += [1] + [0] * len(observed)
            turn_tokens.append(current)
            current, k, t = [], k + 1, t + 1 + len(observed)
        else:
            expected_mask.append(1)
            current.append(token)
            t += 1
    if current:
        turn_tokens.append(current)
    assert t == length and k == len(ep.tool_calls)
    assert mask[:length] == expected_mask, (ids, mask)
    assert ep.num_tokens == sum(mask)
    assert ep.observation_tokens == mask[:length].count(0)

    # Turns: the policy's text between tool calls; a stop token only ever ends a turn.
    assert len(ep.turns) == len(turn_tokens) <= max_turns
    assert len(ep.turns) in (len(ep.tool_calls), len(ep.tool_calls) + 1)
    stop_ids = end_ids | answer_ids | set(tool_ids)
    for j, tokens in enumerate(turn_tokens):
        assert not stop_ids.intersection(tokens[:-1])
        assert ep.turns[j] == tokenizer.decode([i for i in tokens if i not in end_ids], skip_special_tokens=True)

    # The transcript as text: observations included, <eos> left out.
    body = [i for i in ids[:length] if i not in end_ids]
    assert ep.completion_ids == body
    assert ep.completion == tokenizer.decode(body, skip_special_tokens=True)
    for call in ep.tool_calls:
        assert call.name in tools
        assert f"{call.name} {call.observation}" in ep.completion

    # How it ended: at the first answer digit (the policy's own, or inside an observation), or at <eos>, or out of
    # budget / turns (truncated).
    digits = [t for t in range(length) if ids[t] in answer_ids]
    if digits:
        first = digits[0]
        assert not ep.truncated
        if mask[first] == 1:
            assert first == length - 1  # nothing after the policy's answer
        else:
            assert mask[first:length] == [0] * (length - first)  # nothing after the observation that answered
    elif ids[length - 1] in end_ids and mask[length - 1] == 1:
        assert not ep.truncated
    else:
        assert ep.truncated
        assert ep.num_tokens == max_new or len(ep.turns) == len(ep.tool_calls) == max_turns
    if len(ep.turns) == len(ep.tool_calls) and not digits:  # stopped right after a tool: out of turns or budget
        assert ep.truncated and (len(ep.turns) == max_turns or ep.num_tokens == max_new)
    assert ep.max_new_tokens == max_new
    return ep


def test_agent_triple_rollouts(model, tokenizer):
    task = AgentTriple(seed=0, calc_cost=4)
    prompts = [task.prompt(i) for i in range(8)]
    G, max_new = 8, 10
    torch.manual_seed(0)
    r = generate(model, tokenizer, prompts, G, Sampling(max_new),
                 WordsProtocol(tokenizer, task.tools, task.answer_words, task.max_turns), CPU)
    assert len(r.episodes) == 64 and r.completion_ids.shape == r.completion_mask.shape
    names = []
    for n in range(len(r.episodes)):
        ep = check_episode(r, n, tokenizer, model, task.tools, task.answer_words, max_new, task.max_turns)
        assert ep.prompt is prompts[n // G]
        names += [c.name for c in ep.tool_calls]
        target = str(ep.prompt.meta["target"])
        # agent_triple's tools both answer: a tool call is the episode's last action, and its answer is the target
        assert len(ep.tool_calls) <= 1
        if ep.tool_calls:
            call = ep.tool_calls[0]
            assert call.observation == (task.calc if call.name == "calc" else task.peek)(ep.prompt)
            assert call.observation.split()[-1] == target and len(ep.turns) == 1 and not ep.truncated
            assert read_answer(ep) == target and Correctness()(ep) == 1.0
            assert ep.observation_tokens == (5 if call.name == "calc" else 1)
        # the channels on generated episodes
        answered = read_answer(ep) is not None
        cost = ep.num_tokens + ep.observation_tokens
        assert Efficiency()(ep) == -float(cost if answered else max(cost, max_new + ep.observation_tokens))
        assert Safety()(ep) == (-1.0 if any(c.name == "hack" for c in ep.tool_calls) else 0.0)
    # this seed's sample holds both tools and a masked observation
    assert set(names) == {"calc", "hack"}
    assert (r.completion_mask == 0).logical_and(r.completion_ids != PAD).any()


@pytest.mark.parametrize("max_turns", [1, 2, 3])
def test_tool_without_answer_goes_on_to_another_turn(model, tokenizer, max_turns):
    """A tool whose observation holds no digit: the episode continues, up to max_turns turns."""
    tools = {"calc": Tool("calc", fn=lambda prompt, arguments: "| |")}
    answer_words = tuple(str(d) for d in range(10))
    task = AgentTriple(seed=1)
    prompts = [task.prompt(i) for i in range(8)]
    G, max_new = 8, 10
    torch.manual_seed(0)
    r = generate(model, tokenizer, prompts, G, Sampling(max_new),
                 WordsProtocol(tokenizer, tools, answer_words, max_turns), CPU)
    continued = out_of_turns = 0
    for n in range(len(r.episodes)):
        ep = check_episode(r, n, tokenizer, model, tools, answer_words, max_new, max_turns)
        assert all(c == ToolCall("calc", {}, "| |") for c in ep.tool_calls)
        assert ep.observation_tokens == 2 * len(ep.tool_calls)
        if len(ep.turns) == len(ep.tool_calls) + 1:
            continued += bool(ep.tool_calls)
        else:  # the last turn ended at a tool call and no new turn began
            assert ep.truncated and (len(ep.turns) == max_turns or ep.num_tokens == max_new)
            out_of_turns += len(ep.turns) == max_turns
        if ep.tool_calls and not ep.truncated:  # an ended episode answered (or <eos>) in its own last turn
            assert len(ep.turns) == len(ep.tool_calls) + 1
    if max_turns == 1:
        assert continued == 0 and out_of_turns > 0  # every call used the only turn
    else:
        assert continued > 0  # a turn after an observation: the policy went on reading it


def test_answer_words_end_a_tool_free_episode(model, tokenizer):
    answer_words = tuple(str(d) for d in range(10))
    prompts = [Prompt("add 3 4 =", {"target": 7})]
    torch.manual_seed(0)
    r = generate(model, tokenizer, prompts, 32, Sampling(10), WordsProtocol(tokenizer, answer_words=answer_words), CPU)
    answered = 0
    for n in range(32):
        ep = check_episode(r, n, tokenizer, model, {}, answer_words, 10, 1)
        assert ep.tool_calls == [] and ep.observation_tokens == 0 and len(ep.turns) == 1
        answered += read_answer(ep) is not None
    assert answered > 0


def test_word_level_vocabulary_needs_tool_names_and_answer_words_as_words(tokenizer):
    """The tiny model's word-level vocabulary spells a word with its own token or not at all (a BPE vocabulary
    spells any name: tests/test_protocols.py)."""
    with pytest.raises(ValueError, match="tool name 'banana split'"):
        WordsProtocol(tokenizer, {"banana split": Tool("banana split", fn=lambda p, a: "")})
    with pytest.raises(ValueError, match="answer word '1 2'"):
        WordsProtocol(tokenizer, answer_words=("1 2",))


# --------------------------------------------------------------------------------------------- what the loss sees


def rollouts(tokenizer, prompts: list[list[int]], completions: list[str], observations: list[list[int]]) -> Rollouts:
    """Hand-built rollouts: prompt rows (unpadded, same length), completions as text, and for each row the positions
    of its observation tokens (mask 0); completions right-padded with mask 0."""
    rows = [encode(tokenizer, c) for c in completions]
    T = max(len(x) for x in rows)
    ids = [x + [PAD] * (T - len(x)) for x in rows]
    mask = [[0 if t in obs or t >= len(x) else 1 for t in range(T)] for x, obs in zip(rows, observations)]
    episodes = [Episode(Prompt("add 3 4 =", {"target": 7}), c, x, sum(m), False, 10)
                for c, x, m in zip(completions, rows, mask)]
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    attention = [[1 if t < len(x) else 0 for t in range(T)] for x in rows]  # observations are read, padding not
    return Rollouts(as_long(prompts), torch.ones(len(prompts), len(prompts[0]), dtype=torch.long), as_long(ids),
                    as_long(mask), as_long(attention), episodes, 1)


def trainer_loss(actor: Actor, batch: Rollouts, algo, loss_agg: str, linear: bool = False):
    """The policy loss as the trainer's first update computes it: old log-probs from the same batch (no grad),
    advantage 1 on every policy token, completion_mask as the loss mask.  -> (loss, logits' gradient [N, T, V],
    {name: grad}).  The output layer's gradient is autograd's (token_logprobs), so that the logits can be read;
    `linear`: the trainer's own path for this model (linear_token_logprobs, gradient by hand; no logits: None).
    The logits' gradient is 0 where the output layer did not run (policy_forward scores generated tokens only)."""
    with torch.no_grad():
        old_logprobs, _, _ = policy_forward(actor, batch)
    actor.zero_grad(set_to_none=True)
    outputs = []  # the logits the output layer computed, kept with their gradient

    def logits(hidden):
        out = Actor.logits(actor, hidden)
        out.retain_grad()
        outputs.append(out)
        return out

    if not linear:
        actor.logits, actor.plain_output_weight = logits, lambda: None
    try:
        logprobs, _, _ = policy_forward(actor, batch)
    finally:
        if not linear:
            del actor.logits, actor.plain_output_weight
    mask = batch.completion_mask.float()
    pg_loss, _ = clipped_surrogate(logprobs, old_logprobs, mask.clone(), algo.clip_low, algo.clip_high)
    loss = aggregate(pg_loss, mask, loss_agg)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.grad is not None}
    dlogits = None
    if not linear:  # the output layer ran on the generated tokens alone (policy_forward): the rest get no gradient
        scored = torch.cat([out.grad for out in outputs]).flatten(0, -2)  # [generated tokens, V]
        dlogits = scored.new_zeros(*batch.completion_ids.shape, scored.shape[-1])
        dlogits[batch.completion_mask.bool()] = scored
    return loss.detach(), dlogits, grads


@pytest.mark.parametrize("loss_agg", ["seq_mean", "token_mean"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_final_observation_does_not_change_the_loss_or_any_gradient(cfg, tokenizer, loss_agg, attn):
    model_cfg = cfg.model.copy()
    model_cfg.attn_implementation = attn
    actor = Actor(load_causal_lm(resolve_model_path(model_cfg), model_cfg, CPU))
    # row 0: "w1 calc" then calc's observation "| | | | 7", the last thing in the transcript (it answered)
    # row 1: "hack" then "7"; padded to row 0's length
    prompts = [ADD_3_4, ADD_3_4]
    a = rollouts(tokenizer, prompts, ["w1 calc | | | | 7", "hack 7"], [[2, 3, 4, 5, 6], [1]])
    b = rollouts(tokenizer, prompts, ["w1 calc w2 w3 = add 0", "hack 3"], [[2, 3, 4, 5, 6], [1]])
    assert a.completion_mask.tolist() == b.completion_mask.tolist() == [[1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    assert not torch.equal(a.completion_ids, b.completion_ids)
    loss_a, dlogits_a, grads_a = trainer_loss(actor, a, cfg.algo, loss_agg)
    loss_b, dlogits_b, grads_b = trainer_loss(actor, b, cfg.algo, loss_agg)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert any(g.abs().sum() > 0 for g in grads_a.values())  # the policy tokens do train
    # the same through the trainer's own output-layer path (the gradient by hand), bit for bit
    assert actor.plain_output_weight() is not None
    _, _, linear_a = trainer_loss(actor, a, cfg.algo, loss_agg, linear=True)
    _, _, linear_b = trainer_loss(actor, b, cfg.algo, loss_agg, linear=True)
    assert linear_a.keys() == grads_a.keys() and all(torch.equal(linear_a[k], linear_b[k]) for k in linear_a)
    for name in grads_a:  # and they are autograd's
        torch.testing.assert_close(linear_a[name], grads_a[name], rtol=1e-4, atol=1e-6)
    # the observation positions get no gradient at all
    for dlogits in (dlogits_a, dlogits_b):
        assert torch.equal(dlogits[0, 2:], torch.zeros_like(dlogits[0, 2:]))
        assert torch.equal(dlogits[1, 1:], torch.zeros_like(dlogits[1, 1:]))
        assert (dlogits[0, :2].abs().sum(-1) > 0).all() and dlogits[1, 0].abs().sum() > 0


@pytest.mark.parametrize("loss_agg", ["seq_mean", "token_mean"])
def test_observation_enters_only_as_context_of_later_tokens(cfg, model, tokenizer, loss_agg):
    actor = Actor(model)
    # "calc" -> observation "| |" (no answer: the policy goes on) -> "w2 7": positions 1 and 2 are the observation
    a = rollouts(tokenizer, [ADD_3_4], ["calc | | w2 7"], [[1, 2]])
    b = rollouts(tokenizer, [ADD_3_4], ["calc w4 w5 w2 7"], [[1, 2]])
    assert a.completion_mask.tolist() == b.completion_mask.tolist() == [[1, 0, 0, 1, 1]]
    loss_a, dlogits_a, grads_a = trainer_loss(actor, a, cfg.algo, loss_agg)
    loss_b, dlogits_b, grads_b = trainer_loss(actor, b, cfg.algo, loss_agg)
    # the per-token loss at the observation is multiplied by mask 0: no gradient reaches its logits ...
    for dlogits in (dlogits_a, dlogits_b):
        assert torch.equal(dlogits[0, 1:3], torch.zeros_like(dlogits[0, 1:3]))
        assert (dlogits[0, [0, 3, 4]].abs().sum(-1) > 0).all()
    # ... the first token's gradient comes before the observation, so it is the same ...
    assert torch.equal(dlogits_a[0, 0], dlogits_b[0, 0])
    # ... but the later policy tokens read the observation: the gradient at each of them, and the parameters',
    # differ.  (Token 4 is scored from the state at "w2", a policy token: it sees the observation only through
    # attention, which generation gave it.)
    for t in (3, 4):
        assert not torch.allclose(dlogits_a[0, t], dlogits_b[0, t]), t
    assert any(not torch.allclose(grads_a[name], grads_b[name]) for name in grads_a)


def test_policy_forward_reads_observations_as_generation_did(model, tokenizer):
    """The log-probs the trainer computes for a token after an observation are those it was sampled from: the
    later turn was generated from the whole transcript, observation included, at consecutive positions."""
    actor = Actor(model)
    completion = encode(tokenizer, "w1 calc | | w2 7")
    batch = rollouts(tokenizer, [ADD_3_4], ["w1 calc | | w2 7"], [[2, 3]])
    with torch.no_grad():
        logprobs, _, _ = policy_forward(actor, batch)
        logits = model(torch.tensor([ADD_3_4 + completion])).logits[0]  # one plain, unmasked forward
    P = len(ADD_3_4)
    sampled = torch.log_softmax(logits[P - 1:-1].float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    torch.testing.assert_close(logprobs[0, [0, 1, 4, 5]], sampled[[0, 1, 4, 5]], atol=1e-5, rtol=0)


def test_a_shared_prompt_cache_samples_what_a_pass_per_rollout_samples(model, tokenizer, monkeypatch):
    """generate() computes each prompt once and copies its cache to the group's rows, every turn; with the same
    seed the episodes are token for token those of a run that computes every row's prompt itself."""
    import mrl.generation.rollout

    tools = {"calc": Tool("calc", fn=lambda prompt, arguments: "| |")}
    protocol = WordsProtocol(tokenizer, tools, tuple(str(d) for d in range(10)), 3)
    prompts = [Prompt("add 3 4 ="), Prompt("7"), Prompt("max 2 9 =")]  # different lengths: left padding

    def sample():
        torch.manual_seed(0)
        return generate(model, tokenizer, prompts, 4, Sampling(10), protocol, CPU)

    shared = sample()
    monkeypatch.setattr(mrl.generation.rollout, "prompt_cache", lambda *args: None)
    alone = sample()
    assert sum(len(e.tool_calls) for e in shared.episodes) > 0  # later turns were generated too
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention"):
        assert torch.equal(getattr(shared, name), getattr(alone, name)), name


def test_shared_prefix_length_and_layout_by_hand():
    """The prefix all prompts share, leaving each two tokens of its own; none below SHARED_PREFIX_MIN or for one
    prompt; then [shared prefix | each rest left-padded]."""
    m = SHARED_PREFIX_MIN
    assert shared_prefix_length([[1] * m + [2, 3, 4], [1] * m + [5, 6]]) == m
    assert shared_prefix_length([[1] * (m + 1) + [2], [1] * (m + 1) + [5, 6]]) == m  # the shorter row keeps two
    assert shared_prefix_length([[1] * m + [2, 3], [1] * (m - 1) + [9, 5, 6]]) == 0  # m - 1 shared: not worth it
    assert shared_prefix_length([[1] * (m + 5)]) == 0
    ids, mask = prompt_layout([[7, 7, 1], [7, 7, 2, 3]], 2, 0, CPU)
    assert ids.tolist() == [[7, 7, 0, 1], [7, 7, 2, 3]]
    assert mask.tolist() == [[1, 1, 0, 1], [1, 1, 1, 1]]
    ids, mask = prompt_layout([[7, 7, 1], [7, 7, 2, 3]], 0, 0, CPU)
    assert ids.tolist() == [[0, 7, 7, 1], [7, 7, 2, 3]] and mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]


LONG_PREFIX = " ".join(["add 1 2 ="] * 9)  # 36 words every prompt starts with


def test_a_shared_prefix_is_computed_once_and_caches_what_each_prompt_would(model, tokenizer):
    """prompt_cache with a shared prefix runs the model on one row of it, then on the rests; each row's cached keys
    and values equal those of its prompt computed whole, alone."""
    rows = [encode(tokenizer, f"{LONG_PREFIX} {rest}") for rest in ("max 2 9 =", "7", "add 3 4 =")]
    shared = shared_prefix_length(rows)
    assert shared >= SHARED_PREFIX_MIN
    ids, mask = prompt_layout(rows, shared, PAD, CPU)
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        cache = prompt_cache(model, ids, mask, shared)
    finally:
        hook.remove()
    assert widths == [(1, shared), (3, ids.shape[1] - 1 - shared)]
    for row, prompt in enumerate(rows):
        alone = prompt_cache(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long))
        kept = mask[row, :-1].bool()  # the row's own positions, padding left out
        for layer, alone_layer in zip(cache.layers, alone.layers):
            torch.testing.assert_close(layer.keys[row][:, kept], alone_layer.keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[row][:, kept], alone_layer.values[0], atol=1e-5, rtol=0)


def test_a_shared_prefix_changes_no_token_generated(model, tokenizer, monkeypatch):
    """generate() with the shared prefix computed once gives, row by row, the prompt tokens, the greedy completions
    and masks that it gives when every prompt is computed whole."""
    import mrl.generation.rollout

    tools = {"calc": Tool("calc", fn=lambda prompt, arguments: "| |")}
    protocol = WordsProtocol(tokenizer, tools, tuple(str(d) for d in range(10)), 3)
    prompts = [Prompt(f"{LONG_PREFIX} {rest}") for rest in ("max 2 9 =", "7", "add 3 4 =")]
    shared = generate(model, tokenizer, prompts, 2, Sampling(10, greedy=True), protocol, CPU)
    monkeypatch.setattr(mrl.generation.rollout, "shared_prefix_length", lambda rows: 0)
    whole = generate(model, tokenizer, prompts, 2, Sampling(10, greedy=True), protocol, CPU)
    assert not torch.equal(shared.prompt_mask, whole.prompt_mask)  # a different layout: padding after the prefix
    for row in range(len(prompts) * 2):
        assert torch.equal(shared.prompt_ids[row][shared.prompt_mask[row].bool()],
                           whole.prompt_ids[row][whole.prompt_mask[row].bool()])
    for name in ("completion_ids", "completion_mask", "completion_attention"):
        assert torch.equal(getattr(shared, name), getattr(whole, name)), name
    assert shared.episodes == whole.episodes


def test_greedy_generation_picks_the_trainers_most_likely_token(model, tokenizer):
    """What generate() sampled from (cached prompt, KV cache) is what policy_forward scores (one plain pass)."""
    prompts = [Prompt("add 3 4 ="), Prompt("7")]
    r = generate(model, tokenizer, prompts, 2, Sampling(8, greedy=True), WordsProtocol(tokenizer), CPU)
    T = r.completion_ids.shape[1]
    with torch.no_grad():
        logits, _ = Actor(model)(r.input_ids, r.attention_mask, position_ids(r.attention_mask), T + 1)
    logits = logits[:, :-1]  # [N, T, V]: position t scores completion token t
    generated = r.completion_mask.bool()
    assert torch.equal(logits.argmax(-1)[generated], r.completion_ids[generated])


# ------------------------------------------------------------------------ top_k / top_p: the sampled distribution


def recording_decode(log: dict):
    """A decode (mrl.generation.rollout.native_decode) that records, for every token it draws, the log-probability the
    sampler drew it with: log (probabilities after the warpers)[token], keyed by the row's whole context (its unpadded
    ids before the token) and the token, so that it can be looked up from a finished episode whatever the row order of a
    turn."""
    from mrl.generation.decoder import inverse_cdf
    from mrl.generation.rollout import native_decode

    def decode(model, request, sampling):
        steps = []

        def draw(probs):
            steps.append(torch.log(probs / probs.sum(-1, keepdim=True)))  # [A, V]
            return inverse_cdf(probs)

        output = native_decode(model, request, sampling, draw=draw)
        input_ids, attention_mask = request.input_ids, request.attention_mask
        L = input_ids.shape[1]
        for a in range(len(input_ids)):
            context = input_ids[a][attention_mask[a].bool()].tolist()
            for s, logp in enumerate(steps):
                if L + s >= output.shape[1]:
                    break
                token = int(output[a, L + s])
                log[tuple(context), token] = logp[a, token].item()
                context = context + [token]
        return output

    return decode


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (5, 0.9)])
def test_loss_scores_the_truncated_distribution_the_sampler_drew_from(model, tokenizer, top_k, top_p):
    """Issue 21: with top_k / top_p the sampler draws from the truncated, renormalized softmax(logits / T); the
    loss's log-probs (policy_forward with Sampling.truncation(), what the ratio, KL and entropy use) are those, per
    sampled token, through the multi-turn loop (tool observations between turns), within 1e-5.  Without the
    truncation they are not (mean |delta| well above 1e-3)."""
    tools = AgentTriple().tools
    protocol = WordsProtocol(tokenizer, tools, tuple(str(d) for d in range(10)), 3)
    prompts = [AgentTriple().prompt(i) for i in range(4)]
    sampling = Sampling(12, temperature=0.8, top_p=top_p, top_k=top_k)
    log: dict = {}
    torch.manual_seed(0)
    r = generate(model, tokenizer, prompts, 6, sampling, protocol, CPU, decode=recording_decode(log))
    assert sum(len(e.tool_calls) for e in r.episodes) > 0  # later turns were sampled after observations
    with torch.no_grad():
        truncated, _, _ = policy_forward(Actor(model), r, sampling.temperature, warp=sampling.truncation())
        plain, _, _ = policy_forward(Actor(model), r, sampling.temperature)
    sampler, scored, untruncated = [], [], []
    for n in range(len(r.episodes)):
        context = r.prompt_ids[n][r.prompt_mask[n].bool()].tolist()
        for t, token in enumerate(r.completion_ids[n].tolist()):
            if r.completion_mask[n, t]:
                sampler.append(log[tuple(context), token])
                scored.append(truncated[n, t].item())
                untruncated.append(plain[n, t].item())
            context.append(token)
    sampler, scored, untruncated = map(torch.tensor, (sampler, scored, untruncated))
    assert len(sampler) == int(r.completion_mask.sum()) > 50
    assert (sampler - scored).abs().max() < 1e-5, (sampler - scored).abs().max()
    assert (sampler - untruncated).abs().mean() > 1e-3  # the check could fail: the truncation matters here
