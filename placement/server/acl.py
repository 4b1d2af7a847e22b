"""The users of a fleet's Redis, and what each may do (Redis ACLs).

One Redis is the fleet's broker, result store and ledger, so whoever holds its URL could
otherwise rewrite the ledger, read every queue, send the fleet's internal tasks, steer
workers through Celery's remote control, or `CONFIG SET dir` and `SAVE` a file of their
choosing as the fleet's OS user. So a fleet's Redis has three users, and `gpufleet up`'s
bundled Redis runs with exactly these rules (docs/deploy.md, "Security", gives the same
file for a Redis of your own):

- `caller`, the URL `gpufleet url` prints: send calls (LPUSH to the router's public queue
  `celery`, and the queue declaration Celery's client makes first; WAIT, with which the
  project's client waits for a replica to hold its call), read results
  (GET, MGET and SUBSCRIBE on `celery-task-meta-*`) and streamed text (XREAD on
  `gpufleet-stream-*`: `tasks.serving.streams`). Nothing else: no other queue, no
  ledger key, no Celery remote-control channel, no admin command. On Redis 7 and later
  its rights are split by command (ACL selectors), so it may write only the keys each
  command needs, and may send chords (Celery's client sets a chord's size on a group
  key). Redis 6.2 has no selectors: there every command it has reaches every key it may
  touch, so it gets no SET or DEL (no chords), and SADD, which declaring a queue needs,
  also reaches the empty queue itself; a router repairs a queue key that is not a list
  as it next takes from it (`tasks.broker.transport.repair_queue_keys`).
- `operator`, for `gpufleet status` and `gpufleet metrics`: read-only commands on every
  key; no writes, no channels, no admin commands.
- `fleet`, for the fleet's own processes (router, GPU workers, Flower, the launcher):
  every key and channel, every command but Redis's `@dangerous` ones (CONFIG, DEBUG,
  MODULE, SAVE, SHUTDOWN, FLUSHALL, REPLICAOF, KEYS, ...), less INFO, CLIENT LIST and
  CLIENT KILL, with which the launcher keeps callers' connections within their share
  (`placement.server.connections`).

A bundled Redis with Sentinels (`gpufleet up --redis-ha`, `placement.server.sentinel`)
has two more users, whose passwords no process but the launcher's Redis nodes and
Sentinels ever sees: `replication`, with which a replica reads its primary's stream
(PSYNC, REPLCONF), and `sentinel`, with which the Sentinels watch and reconfigure the
data nodes (INFO, REPLICAOF, CONFIG REWRITE, ...) and sign in to each other. On the
Sentinels themselves the fleet's three users may only ask where the primary, the
replicas and the other Sentinels are, and hear when the primary moves
(`SENTINEL_LOOKUP_RULES`): none may reconfigure, fail over or remove the group.

The `default` user is off and has no password, so no connection can be it. It may still
run every command on every key: Redis replays its append-only file as `default`, and from
Redis 7 EXEC checks the rights of each command it runs, so a `default` that may run
nothing would make a restarted Redis drop, silently, every MULTI/EXEC block in the file,
which is how Redis logs each Lua script's writes (the whole ledger; redis/redis#14541).
Passwords are stored as SHA-256 digests (`#<hex>`), so the ACL file holds no password.
"""

from __future__ import annotations

import hashlib
import urllib.parse
from dataclasses import dataclass

from placement.ledger.tenancy import tenants

__all__ = [
    "ADMIN",
    "CALLER",
    "FLEET",
    "OPERATOR",
    "REPLICATION",
    "SENTINEL",
    "USERS",
    "Users",
    "acl_lines",
    "sentinel_acl_lines",
    "tenant_line",
    "tenant_rules",
    "tenant_sentinel_line",
    "user_url",
]

FLEET = "fleet"
OPERATOR = "operator"
CALLER = "caller"
USERS = (FLEET, OPERATOR, CALLER)
REPLICATION = "replication"
SENTINEL = "sentinel"
ADMIN = "admin"

#: kombu's priority steps above 0 (`tasks.broker.presence.PRIORITY_STEPS`, which a test
#: keeps equal): a queue's list for each, `celery\x06\x16N`, is one a router reads.
PRIORITY_LISTS = (3, 6, 9)
#: What Celery's client declares before it sends to a queue (kombu 5.7 writes the second).
_DECLARE = ("_kombu.binding.", "_kombu.binding_permanent.")
_RESULTS, _GROUPS = "celery-task-meta-", "celery-taskset-meta-"  # Celery's key prefixes
_STREAMS = "gpufleet-stream-"  # tasks.serving.streams.PREFIX
_CONNECTION = "+ping +echo +select +hello +auth +multi +exec +discard"

_FLEET_RULES = "~* &* +@all -@dangerous +info +client|list +client|kill"
#: What the append-only file's replay may run (see the module); the user itself is off.
_DEFAULT_RULES = "~* &* +@all"
_OPERATOR_RULES = f"~* resetchannels -@all {_CONNECTION} +@read -keys +time"
#: The launcher's own user for tenants' users (`TenantUsers`), on the bundled Redis only.
_ADMIN_RULES = f"resetchannels -@all {_CONNECTION} +acl|setuser +acl|deluser +acl|users"


def _queue_keys(prefix: str) -> tuple[list[str], list[str]]:
    """The keys of the public queue `celery` under a client's `global_keyprefix`, exactly:
    its list and its priority lists (no other list a caller could fill and no router would
    read: a list nobody empties holds its junk for ever), and what declaring it writes.
    Patterns as ACL SETUSER takes them (`conf_text` quotes them for a file), so
    `celery-task-meta-*`, `celeryev`, and every in-flight list stay out."""
    queue = f"{prefix}celery"
    lists = [f"~{queue}", *(f"~{queue}\x06\x16{n}" for n in PRIORITY_LISTS)]
    return lists, [f"~{prefix}{kind}celery" for kind in _DECLARE]


def caller_rules(redis_major: int, prefix: str = "") -> list[str]:
    """A caller's rules, one ACL argument each: send calls to the public queue `celery`,
    wait for results and read streamed text, all under `prefix` (a tenant's,
    `placement.ledger.tenancy.tenants.key_prefix`, so it reaches its own calls' results
    and streams only; the `caller` user's is ""). Redis 7 and later: root rights send
    calls and wait for results, and each selector grants one command group on the keys it
    needs; Redis 6.2: one set of keys for all of its commands (see the module)."""
    queue, declare = _queue_keys(prefix)
    connection = _CONNECTION.split()
    results, groups, streams = (f"~{prefix}{kind}*" for kind in (_RESULTS, _GROUPS, _STREAMS))
    channels = f"&{prefix}{_RESULTS}*"
    if redis_major >= 7:
        return [
            "resetkeys", *queue, "resetchannels", channels, "-@all", *connection,
            "+lpush", "+wait", "+llen", "+subscribe", "+unsubscribe",
            "(+sadd", "+smembers", *declare[:-1], f"{declare[-1]})",
            "(+get", "+mget", results, f"{groups})",
            "(+set", "+del", f"{groups})",
            "(+xread", f"{streams})",
        ]  # fmt: skip
    return [
        "resetkeys", *queue, *declare, results, groups, streams,
        "resetchannels", channels, "-@all", *connection,
        "+lpush", "+wait", "+llen", "+sadd", "+smembers", "+get", "+mget", "+xread",
        "+subscribe", "+unsubscribe",
    ]  # fmt: skip


def conf_text(rules: list[str]) -> str:
    """`rules` as a line of redis.conf or an ACL file writes them: a rule with a control
    character quoted, the character as `\\xHH` (which both read)."""
    out = []
    for rule in rules:
        if any(ord(c) < 32 for c in rule):
            escaped = "".join(f"\\x{ord(c):02x}" if ord(c) < 32 else c for c in rule)
            out.append(f'"{escaped}"')
        else:
            out.append(rule)
    return " ".join(out)


#: A replica reading its primary (Redis's replication handshake).
_REPLICATION_RULES = "resetchannels -@all +ping +auth +psync +sync +replconf"
#: A Sentinel on a data node: the rights Redis's Sentinel documentation lists.
_SENTINEL_RULES = (
    "allchannels -@all +auth +hello +ping +multi +exec +slaveof +replicaof +config|rewrite "
    "+role +publish +subscribe +info +client|setname +client|kill +script|kill"
)
#: The fleet's users on a Sentinel: where the group's nodes are, and when the primary
#: moves (`placement.ledger.primaries` hears ``+switch-master``), nothing more.
SENTINEL_LOOKUP_RULES = (
    "-@all +auth +hello +ping +client|setname +sentinel|masters "
    "+sentinel|master +sentinel|slaves +sentinel|replicas +sentinel|sentinels "
    "+sentinel|get-master-addr-by-name +subscribe +unsubscribe resetchannels &+switch-master"
)


@dataclass(frozen=True)
class Users:
    """The passwords of a fleet's three users, and with Sentinels those of `replication`
    and `sentinel` ("" where the fleet has none)."""

    fleet: str
    operator: str
    caller: str
    replication: str = ""
    sentinel: str = ""
    admin: str = ""  # the launcher's, for tenants' users (`TenantUsers`)

    def password(self, user: str) -> str:
        passwords: dict[str, str] = {
            FLEET: self.fleet,
            OPERATOR: self.operator,
            CALLER: self.caller,
            REPLICATION: self.replication,
            SENTINEL: self.sentinel,
            ADMIN: self.admin,
        }
        return passwords[user]

    def internal(self) -> tuple[str, ...]:
        """The users of a replicated group this has passwords for."""
        return tuple(u for u in (REPLICATION, SENTINEL) if self.password(u))


def rules(user: str, redis_major: int) -> str:
    """The ACL rules of `user` (one of `USERS`) for a Redis of version `redis_major`."""
    if user == FLEET:
        return _FLEET_RULES
    if user == OPERATOR:
        return _OPERATOR_RULES
    if user == CALLER:
        return conf_text(caller_rules(redis_major))
    raise ValueError(f"no gpufleet user {user!r}; the users are {', '.join(USERS)}")


def acl_lines(users: Users, redis_major: int) -> list[str]:
    """The lines of an ACL file (or of redis.conf) for the fleet's users."""
    internal = {REPLICATION: _REPLICATION_RULES, SENTINEL: _SENTINEL_RULES}
    lines = [f"user default off resetpass {_DEFAULT_RULES}"]
    for user in USERS:
        lines.append(_user_line(user, users.password(user), rules(user, redis_major)))
    for user in users.internal():
        lines.append(_user_line(user, users.password(user), internal[user]))
    if users.admin:
        lines.append(_user_line(ADMIN, users.admin, _ADMIN_RULES))
    return lines


def tenant_rules(name: str, redis_major: int) -> list[str]:
    """The ACL rules of tenant `name`'s user: a caller's, on its own public queue
    (`placement.ledger.tenancy.tenants`)."""
    return caller_rules(redis_major, tenants.key_prefix(name))


def tenant_line(tenant: tenants.Tenant, redis_major: int) -> str:
    """The ACL file line of `tenant`'s user, for a Redis of your own."""
    rules = conf_text(tenant_rules(tenant.name, redis_major))
    return f"user {tenants.user_of(tenant.name)} reset on #{tenant.digest} {rules}"


def tenant_sentinel_line(tenant: tenants.Tenant) -> str:
    """The line of `tenant`'s user for Sentinels of your own: it may find the primary."""
    user = tenants.user_of(tenant.name)
    return f"user {user} reset on #{tenant.digest} {SENTINEL_LOOKUP_RULES}"


def sentinel_acl_lines(users: Users) -> list[str]:
    """The lines of a Sentinel's config for the fleet's users: the fleet's three may look
    the group up, `sentinel` (the other Sentinels) may do all."""
    lines = ["user default off resetpass -@all"]
    for user in USERS:
        lines.append(_user_line(user, users.password(user), SENTINEL_LOOKUP_RULES))
    lines.append(_user_line(SENTINEL, users.sentinel, "allchannels +@all"))
    return lines


def _user_line(user: str, password: str, user_rules: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"user {user} reset on #{digest} {user_rules}"


def user_url(url: str, user: str, password: str) -> str:
    """`url` (redis:// or rediss://, any host, port and database; or the Sentinels'
    `sentinel://...;sentinel://...?master_name=`, each of them) as `user`."""
    if ";" in url:
        return ";".join(user_url(part, user, password) for part in url.split(";"))
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
