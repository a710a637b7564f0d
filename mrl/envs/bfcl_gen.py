"""bfcl_gen: generated BFCL-format multi-turn entries over BFCL's own classes, an agent gym a small model can learn.

Each task family is a template: short user turns (1-3) over one or two of BFCL's classes (the file system,
messaging, ticketing, math, vehicle control, trading), a small `initial_config` for them, and the ground truth's call
strings per turn, with names, paths, texts and numbers drawn from a `random.Random` seeded with the entry's id.  An
entry is in BFCL's own format (`id`, `question`, `initial_config`, `involved_classes`, `ground_truth`), so it runs
through bfcl_agent's world, checks and channels unchanged (correctness, turns, efficiency, safety).

How it departs from BFCL's multi-turn set: many short instances of few templates instead of 200 long hand-written
entries, so the train stream is unlimited (`prompt(index)` generates entry `index`), the demonstrations are the
generator's ground truth, and the held-out sets have hundreds of entries.  Two holdouts, the same whatever the
training seed: `id` (new instances of the training families; a train instance equal to a held-out one is drawn
again) and `ood` (families never trained on).  `eval_prompts()` interleaves them (id, ood, id, ...), so that any
`trainer.eval_prompts` takes both halves alike; the evaluation reports each as eval/<holdout>/... (the prompts'
meta["holdout"]), and each family as eval/<family>/accuracy (meta["category"]).

An entry's id names its stream, family and number (`bfcl_gen/<stream>/<family>/<n>[/r<k>]`) and regenerates it
(`entry_by_id`): the channels find an episode's entry from its prompt's meta alone.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import lru_cache

from mrl.core.config import UserError
from mrl.core.data import train_split_only
from mrl.core.episode import Demonstration, Prompt
from mrl.envs import bfcl_agent
from mrl.envs.bfcl_agent import BfclWorld, entry_demonstration, entry_prompt, gym
from mrl.envs.task import TaskBase

SOURCE = "bfcl_gen"  # the prompts' meta["source"]: the channels find their entries through entry_by_id
HOLDOUTS = ("id", "ood")
HOLDOUT_ENTRIES = 156  # per holdout: 12 per training family (13 families), 39 per out-of-distribution one (4)

# ------------------------------------------------------------------------------------------------- the vocabulary
NAMES = ["Alice", "Bob", "Carmen", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Keiko", "Liam",
         "Maya", "Nikhil", "Olga", "Pedro", "Quinn", "Rosa", "Samir", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
WORDS = ["budget", "draft", "notes", "report", "summary", "invoice", "plan", "agenda", "memo", "backup", "data",
         "results", "review", "schedule", "todo", "log", "ideas", "specs", "contract", "minutes"]
EXTENSIONS = [".txt", ".md", ".csv", ".log"]
FOLDERS = ["archive", "docs", "projects", "reports", "drafts", "backups", "shared", "old", "finance", "team",
           "scratch", "exports"]
ROOTS = ["workspace", "home", "office", "lab", "studio"]
PHRASES = ["meeting moved to friday", "call the supplier", "budget approved", "review the draft", "ship it today",
           "lunch at noon", "server is back up", "new hire starts monday", "send the invoice", "update the specs",
           "tests are passing", "book the room", "deadline is next week", "check the logs", "thanks for the help"]
TICKET_TITLES = ["Login page error", "Printer offline", "VPN keeps dropping", "Slow laptop", "Email not syncing",
                 "Broken monitor", "Password reset", "Disk almost full", "Missing license", "Wifi outage",
                 "App crashes on start", "Calendar not loading"]
RESOLUTIONS = ["Restarted the service", "Replaced the cable", "Reset the password", "Updated the driver",
               "Cleared the cache", "Reinstalled the app", "Freed disk space", "Renewed the license"]
STOCKS = ["AAPL", "GOOG", "TSLA", "MSFT", "NVDA", "ALPH", "OMEG", "QUAS", "NEPT", "SYNX", "ZETA"]
DOORS = ["driver", "passenger", "rear_left", "rear_right"]


def _file(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = f"{rng.choice(WORDS)}{rng.choice(['', '_', '-'])}{rng.randint(1, 99)}{rng.choice(EXTENSIONS)}"
        if name not in taken:
            taken.add(name)
            return name


def _folder(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = rng.choice(FOLDERS) + rng.choice(["", f"_{rng.randint(1, 9)}"])
        if name not in taken:
            taken.add(name)
            return name


def _file_system(rng: random.Random, files: dict[str, str], folders: dict[str, dict[str, str]]) -> dict:
    """A GorillaFileSystem initial_config: a root folder holding `files` ({name: content}) and `folders` ({name:
    {file: content}}), in a drawn order."""
    def node(content):
        if isinstance(content, dict):
            return {"type": "directory", "contents": {k: node(v) for k, v in content.items()}}
        return {"type": "file", "content": content}

    items = [*files.items(), *folders.items()]
    rng.shuffle(items)
    return {"root": {rng.choice(ROOTS): node(dict(items))}}


def _fs_world(rng: random.Random, extra_files: int = 2, extra_folders: int = 1):
    """(taken names, top-level files, folders) with distractors: files and folders the task never touches (what a
    careless call damages)."""
    taken: set[str] = set()
    files = {_file(rng, taken): rng.choice(PHRASES) for _ in range(extra_files)}
    folders = {_folder(rng, taken): {_file(rng, taken): rng.choice(PHRASES)} for _ in range(extra_folders)}
    return taken, files, folders


def _users(rng: random.Random, count: int = 4) -> dict[str, str]:
    names = rng.sample(NAMES, count)
    ids = rng.sample(range(100, 1000), count)
    return {name: f"USR{i}" for name, i in zip(names, ids)}


def _messages(rng: random.Random, users: dict[str, str], me: str) -> dict:
    """A MessageAPI initial_config: `users`, logged in as `me`, a few messages already in the inbox."""
    others = [u for u in users.values() if u != me]
    inbox = [{rng.choice(others): rng.choice(PHRASES)} for _ in range(rng.randint(2, 3))]
    return {"user_count": len(users), "user_map": dict(users), "inbox": inbox, "message_count": len(inbox),
            "current_user": me, "random_seed": rng.randint(1, 10 ** 6)}


def _tickets(rng: random.Random, count: int = 3) -> dict:
    """A TicketAPI initial_config: `count` open tickets of a logged-in user."""
    user = rng.choice(NAMES).lower()
    ids = sorted(rng.sample(range(1, 400), count))
    queue = [{"id": i, "title": rng.choice(TICKET_TITLES), "description": rng.choice(PHRASES), "status": "Open",
              "priority": rng.randint(1, 5), "created_by": user} for i in ids]
    return {"ticket_queue": queue, "ticket_counter": ids[-1] + 1, "current_user": user}


def _trading(rng: random.Random) -> dict:
    """A TradingBot initial_config: logged in, the market open, a balance, a watchlist, one pending order."""
    order_id = rng.randint(1000, 9999)
    return {"authenticated": True, "market_status": "Open", "order_counter": order_id + 1,
            "account_info": {"account_id": rng.randint(10000, 99999), "balance": float(rng.randint(20, 90) * 1000),
                             "binding_card": rng.randint(10 ** 15, 10 ** 16 - 1)},
            "watch_list": rng.sample(STOCKS, 2),
            "orders": {str(order_id): {"id": order_id, "order_type": "Sell", "symbol": rng.choice(STOCKS),
                                       "price": float(rng.randint(50, 500)), "amount": rng.randint(1, 20),
                                       "status": "Pending"}}}


def _vehicle(rng: random.Random, locked: list[str] = ()) -> dict:
    return {"doorStatus": {d: "locked" if d in locked else "unlocked" for d in DOORS},
            "fuelLevel": float(rng.randint(5, 40)), "acTemperature": float(rng.randint(18, 26))}


def _say(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


Turn = tuple[str, list[str]]  # (the user's message, the ground truth's call strings)
Family = Callable[[random.Random], tuple[dict, list[Turn]]]  # rng -> (initial_config, turns)


# ------------------------------------------------------------------------------------ the training families (14)
def fs_touch(rng):
    taken, files, folders = _fs_world(rng)
    folder, name = next(iter(folders)), _file(rng, taken)
    return ({"GorillaFileSystem": _file_system(rng, files, folders)},
            [(f"Create an empty file named '{name}' inside the '{folder}' folder.",
              [f"cd(folder={folder!r})", f"touch(file_name={name!r})"])])


def fs_echo_cat(rng):
    taken, files, folders = _fs_world(rng)
    name, text = _file(rng, taken), rng.choice(PHRASES)
    return ({"GorillaFileSystem": _file_system(rng, files, folders)},
            [(f"Create a file called '{name}' and write '{text}' into it.",
              [f"touch(file_name={name!r})", f"echo(content={text!r}, file_name={name!r})"]),
             (f"Now show me what '{name}' contains.", [f"cat(file_name={name!r})"])])


def fs_mkdir_cp(rng):
    taken, files, folders = _fs_world(rng)
    source, folder = rng.choice(list(files)), _folder(rng, taken)
    return ({"GorillaFileSystem": _file_system(rng, files, folders)},
            [(f"Make a new folder '{folder}' and copy '{source}' into it.",
              [f"mkdir(dir_name={folder!r})", f"cp(source={source!r}, destination={folder!r})"])])


def fs_mv_ls(rng):
    taken, files, folders = _fs_world(rng, extra_files=3)
    source, folder = rng.choice(list(files)), next(iter(folders))
    return ({"GorillaFileSystem": _file_system(rng, files, folders)},
            [(f"Move '{source}' into the '{folder}' folder.", [f"mv(source={source!r}, destination={folder!r})"]),
             (f"Go into '{folder}' and list its files.", [f"cd(folder={folder!r})", "ls()"])])


def msg_send(rng):
    users = _users(rng)
    me, to = rng.sample(list(users.values()), 2)
    text = rng.choice(PHRASES)
    turns = [(f"Send the message '{text}' to the user with id {to}.",
              [f"send_message(receiver_id={to!r}, message={text!r})"])]
    if rng.random() < 0.5:
        turns.append(("Now show me the messages I have sent.", ["view_messages_sent()"]))
    return {"MessageAPI": _messages(rng, users, me)}, turns


def msg_lookup_send(rng):
    users = _users(rng)
    me, (name, to) = rng.choice(list(users.values())), rng.choice(list(users.items()))
    while to == me:
        name, to = rng.choice(list(users.items()))
    text = rng.choice(PHRASES)
    return ({"MessageAPI": _messages(rng, users, me)},
            [(f"Look up the user id of {name} and send them the message '{text}'.",
              [f"get_user_id(user={name!r})", f"send_message(receiver_id={to!r}, message={text!r})"])])


def ticket_create(rng):
    """1-3 turns: create; then change the new ticket's priority (its id is in the creation's result); then show."""
    config = _tickets(rng)
    title, priority, new = rng.choice(TICKET_TITLES), rng.randint(1, 5), config["ticket_counter"]
    turns = [(f"Open a ticket titled '{title}' with priority {priority}.",
              [f"create_ticket(title={title!r}, priority={priority})"])]
    if rng.random() < 2 / 3:
        other = rng.choice([p for p in range(1, 6) if p != priority])
        turns.append((f"Change its priority to {other}.",
                      [f"edit_ticket(ticket_id={new}, updates={{'priority': {other}}})"]))
        if rng.random() < 0.5:
            turns.append(("Show me that ticket.", [f"get_ticket(ticket_id={new})"]))
    return {"TicketAPI": config}, turns


def ticket_resolve(rng):
    config = _tickets(rng)
    ticket, resolution = rng.choice(config["ticket_queue"])["id"], rng.choice(RESOLUTIONS)
    return ({"TicketAPI": config},
            [(f"Resolve ticket {ticket} with the resolution '{resolution}'.",
              [f"resolve_ticket(ticket_id={ticket}, resolution={resolution!r})"]),
             (f"Show me ticket {ticket}.", [f"get_ticket(ticket_id={ticket})"])])


def math_multiply(rng):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return {}, [(f"What is {a} times {b}?", [f"multiply(a={a}, b={b})"])]


def math_add_divide(rng):
    a, b, c = rng.randint(2, 200), rng.randint(2, 200), rng.randint(2, 9)
    return {}, [(f"Add {a} and {b}, then divide the sum by {c}.",
                 [f"add(a={a}, b={b})", f"divide(a={float(a + b)}, b={c})"])]


def vehicle_lock(rng):
    doors = rng.sample(DOORS, rng.randint(1, 3))
    config = _vehicle(rng, locked=rng.sample([d for d in DOORS if d not in doors], 1))
    return ({"VehicleControlAPI": config},
            [(f"Lock the {_say(doors)} door{'s' * (len(doors) > 1)}.", [f"lockDoors(unlock=False, door={doors!r})"])])


def vehicle_climate(rng):
    temperature, fan = rng.randint(16, 28), rng.randrange(10, 100, 10)
    return ({"VehicleControlAPI": _vehicle(rng)},
            [(f"Set the air conditioning to {temperature} degrees Celsius with the fan speed at {fan}.",
              [f"adjustClimateControl(temperature={temperature}, unit='celsius', fanSpeed={fan})"])])


def trading_buy(rng):
    symbol, amount, price = rng.choice(STOCKS), rng.randint(1, 20), rng.randint(20, 400)
    return ({"TradingBot": _trading(rng)},
            [(f"Place a Buy order for {amount} shares of {symbol} at {price} dollars each.",
              [f"place_order(order_type='Buy', symbol={symbol!r}, price={price}, amount={amount})"])])


def trading_watch(rng):
    config = _trading(rng)
    symbol = rng.choice([s for s in STOCKS if s not in config["watch_list"]])
    return ({"TradingBot": config},
            [(f"Add {symbol} to my watchlist.", [f"add_to_watchlist(stock={symbol!r})"]),
             ("Now show me my watchlist.", ["get_watchlist()"])])


# ---------------------------------------------------------------- the out-of-distribution families (4), never trained
def ood_fs_rename_cat(rng):
    taken, files, folders = _fs_world(rng, extra_files=3)
    source, target = rng.choice(list(files)), _file(rng, taken)
    return ({"GorillaFileSystem": _file_system(rng, files, folders)},
            [(f"Rename '{source}' to '{target}'.", [f"mv(source={source!r}, destination={target!r})"]),
             (f"Show me what '{target}' contains.", [f"cat(file_name={target!r})"])])


def ood_ticket_close(rng):
    config = _tickets(rng)
    ticket = rng.choice(config["ticket_queue"])["id"]
    return {"TicketAPI": config}, [(f"Close ticket {ticket}.", [f"close_ticket(ticket_id={ticket})"])]


def ood_file_to_message(rng):
    """Two classes: read a file, then message its content (the message is the first call's result)."""
    taken, files, folders = _fs_world(rng)
    source = rng.choice(list(files))
    users = _users(rng)
    me, to = rng.sample(list(users.values()), 2)
    return ({"GorillaFileSystem": _file_system(rng, files, folders), "MessageAPI": _messages(rng, users, me)},
            [(f"Read the file '{source}' and send its content as a message to the user with id {to}.",
              [f"cat(file_name={source!r})", f"send_message(receiver_id={to!r}, message={files[source]!r})"])])


def ood_trading_fund(rng):
    amount = rng.randint(1, 50) * 100
    return ({"TradingBot": _trading(rng)},
            [(f"Deposit {amount} dollars into my trading account.", [f"fund_account(amount={amount})"])])


TRAIN_FAMILIES: dict[str, Family] = {f.__name__: f for f in (
    fs_touch, fs_echo_cat, fs_mkdir_cp, fs_mv_ls, msg_send, msg_lookup_send, ticket_create, ticket_resolve,
    math_multiply, math_add_divide, vehicle_lock, vehicle_climate, trading_buy, trading_watch)}
OOD_FAMILIES: dict[str, Family] = {f.__name__: f for f in (
    ood_fs_rename_cat, ood_ticket_close, ood_file_to_message, ood_trading_fund)}
FAMILIES = TRAIN_FAMILIES | OOD_FAMILIES


# --------------------------------------------------------------------------------------------------- the entries
@lru_cache(maxsize=65536)
def entry_by_id(entry_id: str) -> dict:
    """The entry an id names (`bfcl_gen/<stream>/<family>/<n>[/r<k>]`), generated from a Random seeded with the id:
    the same id gives the same entry in any process.  Treat it as read-only (it is cached)."""
    parts = entry_id.split("/")
    if len(parts) < 4 or parts[0] != SOURCE or parts[2] not in FAMILIES:
        raise UserError(f"{entry_id!r} is no bfcl_gen entry id; ids read bfcl_gen/<stream>/<family>/<n>, family one "
                        f"of {sorted(FAMILIES)}")
    family = parts[2]
    config, turns = FAMILIES[family](random.Random(entry_id))
    if not config:  # a stateless class alone (math): no scenario to load
        config = {"MathAPI": {}}
    return {"id": entry_id, "category": family, "involved_classes": list(config), "initial_config": config,
            "question": [[{"role": "user", "content": text}] for text, _ in turns],
            "ground_truth": [calls for _, calls in turns]}


bfcl_agent.ENTRY_SOURCES[SOURCE] = entry_by_id


def _signature(entry: dict) -> str:
    """What makes two entries the same task: the user's turns and the world they start from."""
    return json.dumps([entry["question"], entry["initial_config"]], sort_keys=True)


def _distinct(stream: str, family: str, n: int, taken: set[str]) -> dict:
    """Entry `n` of `family` in `stream`, drawn again (`/r1`, `/r2`, ...) while it equals one in `taken`."""
    entry_id, attempt = f"{SOURCE}/{stream}/{family}/{n}", 0
    while _signature(entry := entry_by_id(entry_id)) in taken:
        attempt += 1
        entry_id = f"{SOURCE}/{stream}/{family}/{n}/r{attempt}"
    return entry


@lru_cache(maxsize=None)
def holdout(name: str, size: int = HOLDOUT_ENTRIES) -> tuple[dict, ...]:
    """A holdout's `size` entries, the same whatever the training seed, families in turn, no two the same: `id`
    from the training families, `ood` from the out-of-distribution ones."""
    families = list(TRAIN_FAMILIES if name == "id" else OOD_FAMILIES)
    taken: set[str] = set()
    entries = []
    for k in range(size):
        entry = _distinct(name, families[k % len(families)], k // len(families), taken)
        taken.add(_signature(entry))
        entries.append(entry)
    return tuple(entries)


@lru_cache(maxsize=None)
def _held_signatures(size: int) -> frozenset[str]:
    return frozenset(_signature(e) for name in HOLDOUTS for e in holdout(name, size))


def train_entry(seed: int, index: int, size: int = HOLDOUT_ENTRIES) -> dict:
    """Train entry `index` of `seed`: the training families in turn, never one of the held-out entries."""
    families = list(TRAIN_FAMILIES)
    return _distinct(f"train{seed}", families[index % len(families)], index // len(families),
                     set(_held_signatures(size)))


class BfclGenTask(TaskBase):
    """Generated BFCL-format multi-turn entries as agent episodes, on bfcl_agent's world and channels.

    seed: the training stream's (the holdouts are the same for every seed).
    holdout_entries: entries per holdout (id, ood); at least 150 for a measurement, fewer for a quick check.
    max_calls_per_turn, compact_docs, gold_functions_only: as bfcl_agent's (`mrl.envs.bfcl_agent.BfclAgentTask`).
    """

    def __init__(self, seed: int = 0, holdout_entries: int = HOLDOUT_ENTRIES, max_calls_per_turn: int = 4,
                 compact_docs: bool = True, gold_functions_only: bool = False):
        if holdout_entries < 1:
            raise UserError(f"rewards.task.holdout_entries={holdout_entries} must be at least 1 (156 by default)")
        if max_calls_per_turn < 2:
            raise UserError(f"rewards.task.max_calls_per_turn={max_calls_per_turn} must be at least 2 (the ground "
                            "truth makes up to 2 calls a turn), e.g. 4")
        self.seed, self.holdout_entries = seed, holdout_entries
        self.max_calls_per_turn, self.compact_docs = max_calls_per_turn, compact_docs
        self.gold_only = gold_functions_only
        self.max_turns = 3 * (max_calls_per_turn + 1)  # at most 3 user turns, each its calls and an answer

    def to_prompt(self, entry: dict, holdout_name: str | None = None) -> Prompt:
        meta = {"source": SOURCE} | ({"holdout": holdout_name} if holdout_name else {})
        return entry_prompt(entry, self.gold_only, self.compact_docs, meta=meta)

    def prompt(self, index: int) -> Prompt:
        return self.to_prompt(train_entry(self.seed, index, self.holdout_entries))

    def eval_prompts(self) -> list[Prompt]:
        """Both holdouts, interleaved: id, ood, id, ood, ..."""
        pairs = zip(*(holdout(name, self.holdout_entries) for name in HOLDOUTS))
        return [self.to_prompt(entry, name) for pair in pairs for name, entry in zip(HOLDOUTS, pair)]

    def demonstrations(self, split: str = "train", count: int = 256) -> list[Demonstration]:
        """The first `count` train entries, each solved by its ground truth (calls, their real results, answers)."""
        train_split_only(split, "rewards=bfcl_gen")
        entries = (train_entry(self.seed, i, self.holdout_entries) for i in range(count))
        return [d for e in entries if (d := entry_demonstration(e, self.to_prompt(e), self.max_calls_per_turn))]

    def environment(self, prompt: Prompt) -> BfclWorld:
        return BfclWorld(entry_by_id(prompt.meta["id"]), self.max_calls_per_turn, self.compact_docs, self.gold_only)


def replay(entry: dict, calls: list[list[gym.Call]], gold_only: bool = False) -> dict[str, float]:
    """The channels of calls `(name, arguments)` per user turn on a generated entry, without a model (as bfcl_agent's
    gym.replay: correctness, turns, efficiency, safety)."""
    return gym.replay(entry, calls, gold_only)
