//! Lua scripts: EVAL, EVALSHA, EVAL_RO, EVALSHA_RO and SCRIPT LOAD, EXISTS, FLUSH, KILL, on Lua
//! 5.1 (mlua, built from source) as in Redis.
//!
//! Two ways to run a script, both atomic, both serializable:
//!
//! - **In its keys' shard** (all its KEYS in one shard, the usual case): one exec
//!   (`ScriptExec`) on that shard, holding their locks: no other command on those keys runs while
//!   it does. Its `redis.call`s are built as commands are (`dispatch`) and their execs run inline,
//!   inside the script's exec, over an overlay of the script's own writes
//!   (`copse::exec::Overlay`): each command sees the writes of those before it, nothing is
//!   written while the script runs, and when it ends all its writes go to the engine as one
//!   all-or-nothing batch. A command's reads that need the engine cannot be answered while Lua
//!   runs: the attempt stops at the first one, the exec asks the engine for it, and the script
//!   runs again from its start with that answer kept (`ScriptExec::cache`). Every attempt reads
//!   the same state, since the script holds the locks of all its keys and an attempt's writes
//!   are dropped with it; only the last attempt's effects and reply count.
//! - **Spread** (`spread`): keys of several shards, or a key the script did not declare (the
//!   shard mode hands over when it meets one): run optimistically from the connection's thread,
//!   each call probed in its shard, one checked cross-shard batch at the end, the whole script
//!   run again if a key it read changed meanwhile. Transactions holding a script run this way.
//!
//! Invariants:
//! - In the shard mode, every item a script reads or writes is under its locks (a command
//!   outside them hands over to the spread mode), which is what makes its attempts agree.
//! - Nothing a script does reaches the engine before it ends, and then as one batch. A script
//!   stopped by its time limit (`SCRIPT_TIME_MAX_MS`) has changed nothing.
//! - A spread script commits only if every lock version its probes saw is unchanged under the
//!   locks at its batch (`multi::run`, `Sequence`'s watched versions).
//!
//! Where copse differs from Redis (docs/server.md, "Scripts"): `cjson`, `bit`, `struct` and
//! `cmsgpack` are not loaded; a script past `SCRIPT_TIME_MAX_MS` is stopped with an error instead
//! of making other clients wait with BUSY, and SCRIPT KILL finds nothing to kill; EVAL waits for
//! the connection's earlier replies.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use copse::exec::{
    apply_to_overlay, lock_ids, merge_read, overlay_ops, plan_read, Exec, ExecRequest, ExecStep,
    ExecView, LockIds, Overlay, OverlayRead, ReadOp, ReadOps, ReadResult, StepInput,
};
use futures::channel::oneshot;
use mlua::{Lua, LuaOptions, MultiValue, StdLib, Table, Value};
use sha1::{Digest, Sha1};

use super::{dispatch, find_ignoring_case, parse_i64, Call, Execs, Outcome, Queued, Spec};
use crate::context::{ClientInfo, ConnState, Server};
use crate::resp::Reply;

/// How long one script may run (all its attempts) before it is stopped, with nothing written.
pub const SCRIPT_TIME_MAX_MS: u64 = 5_000;
/// The most memory one thread's Lua state may hold (scripts, their strings and tables): a
/// script past it fails with Lua's "not enough memory" instead of growing the server without
/// bound (`string.rep('x', 2^27)`). Four times the largest value, so a script can hold a few.
pub const SCRIPT_MEMORY_BYTES_MAX: usize = 4 * copse::limits::VALUE_BYTES_MAX;

/// Runs of one script that stop for the engine's reads before it gives up (each brings the
/// reads its attempt needed; a script reads at most this many times in sequence).
pub const SCRIPT_ATTEMPTS_MAX: usize = 10_000;
/// Lua instructions between two looks at the clock (`SCRIPT_TIME_MAX_MS`).
const SCRIPT_CLOCK_INSTRUCTIONS: u32 = 100_000;

/// Commands a script may not call (Redis's `noscript` flag, and copse's commands that run in
/// steps of their own).
const NOT_FROM_SCRIPTS: &[&str] = &[
    "subscribe",
    "psubscribe",
    "ssubscribe",
    "unsubscribe",
    "punsubscribe",
    "sunsubscribe",
    "auth",
    "client",
    "discard",
    "eval",
    "eval_ro",
    "evalsha",
    "evalsha_ro",
    "exec",
    "function",
    "hello",
    "multi",
    "quit",
    "reset",
    "script",
    "unwatch",
    "watch",
    "scrub",
    "swapdb",
    "flushall",
    "flushdb",
    "info",
    "keys",
    "scan",
    "dbsize",
    "randomkey",
    "debug",
    "config",
];

pub fn specs() -> Vec<Spec> {
    let spec = |name, arity, flags, summary, handler| {
        Spec::new("scripting", name, arity, flags, (0, 0, 0), summary, handler)
    };
    const W: &[&str] = &["write", "noscript"];
    const R: &[&str] = &["readonly", "noscript"];
    vec![
        spec("eval", -3, W, "Runs a Lua script.", eval as _),
        spec("evalsha", -3, W, "Runs a cached Lua script by its SHA-1.", evalsha as _),
        spec("eval_ro", -3, R, "Runs a read-only Lua script.", eval_ro as _),
        spec("evalsha_ro", -3, R, "Runs a cached read-only Lua script.", evalsha_ro as _),
        spec("script", -2, &["noscript"], "SCRIPT LOAD, EXISTS, FLUSH, KILL.", script as _),
    ]
}

/// The SHA-1 of a script's source, in lowercase hex (its name for EVALSHA).
pub fn sha1_hex(source: &[u8]) -> String {
    let digest = Sha1::digest(source);
    digest.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn eval(call: &mut Call<'_>) -> Outcome {
    by_source(call, false)
}

fn eval_ro(call: &mut Call<'_>) -> Outcome {
    by_source(call, true)
}

/// EVAL and EVAL_RO: the script is cached by its SHA-1 (EVALSHA finds it after), then run.
fn by_source(call: &mut Call<'_>, read_only: bool) -> Outcome {
    let source: Arc<[u8]> = call.args[1].clone().into();
    let sha = sha1_hex(&source);
    call.server
        .scripts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(sha.clone(), source.clone());
    run(call, sha, source, read_only)
}

fn evalsha(call: &mut Call<'_>) -> Outcome {
    by_sha(call, false)
}

fn evalsha_ro(call: &mut Call<'_>) -> Outcome {
    by_sha(call, true)
}

fn by_sha(call: &mut Call<'_>, read_only: bool) -> Outcome {
    let sha = String::from_utf8_lossy(&call.args[1]).to_ascii_lowercase();
    let source = call.server.scripts.lock().unwrap_or_else(|p| p.into_inner()).get(&sha).cloned();
    match source {
        Some(source) => run(call, sha, source, read_only),
        None => Outcome::error("NOSCRIPT No matching script. Please use EVAL."),
    }
}

fn script(call: &mut Call<'_>) -> Outcome {
    let server = call.server;
    match (call.word(1).as_str(), call.args.len()) {
        ("load", 3) => {
            let source: Arc<[u8]> = call.args[2].clone().into();
            if let Err(error) = compile_check(&source) {
                return Outcome::Reply(error);
            }
            let sha = sha1_hex(&source);
            server.scripts.lock().unwrap_or_else(|p| p.into_inner()).insert(sha.clone(), source);
            Outcome::Reply(Reply::Bulk(sha.into_bytes()))
        }
        ("exists", n) if n >= 3 => {
            let scripts = server.scripts.lock().unwrap_or_else(|p| p.into_inner());
            let found = call.args[2..]
                .iter()
                .map(|sha| {
                    let sha = String::from_utf8_lossy(sha).to_ascii_lowercase();
                    Reply::Integer(i64::from(scripts.contains_key(&sha)))
                })
                .collect();
            Outcome::Reply(Reply::Array(found))
        }
        ("flush", 2) => flush(server),
        ("flush", 3) if matches!(call.word(2).as_str(), "sync" | "async") => flush(server),
        ("flush", 3) => Outcome::error("ERR SCRIPT FLUSH only support SYNC|ASYNC option"),
        ("kill", 2) => Outcome::error("NOTBUSY No scripts in execution right now."),
        (sub @ ("load" | "exists" | "flush" | "kill"), _) => {
            Outcome::error(format!("ERR wrong number of arguments for 'script|{sub}' command"))
        }
        (sub, _) => Outcome::error(format!("ERR unknown subcommand '{sub}'. Try SCRIPT HELP.")),
    }
}

fn flush(server: &Server) -> Outcome {
    server.scripts.lock().unwrap_or_else(|p| p.into_inner()).clear();
    server.scripts_generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    Outcome::Reply(Reply::ok())
}

/// Compiles `source` in a scratch state: SCRIPT LOAD refuses what would not compile.
fn compile_check(source: &[u8]) -> Result<(), Reply> {
    let lua = Lua::new_with(StdLib::NONE, LuaOptions::default())
        .map_err(|err| Reply::Error(format!("ERR {err}")))?;
    match lua.load(source).set_name("@user_script").into_function() {
        Ok(_) => Ok(()),
        Err(err) => Err(Reply::Error(format!(
            "ERR Error compiling script (new function): {}",
            lua_error_text(&err)
        ))),
    }
}

/// Builds the script's exec on the shard of its keys.
fn run(call: &mut Call<'_>, sha: String, source: Arc<[u8]>, read_only: bool) -> Outcome {
    if call.conn.in_exec {
        return Outcome::error("ERR copse does not run scripts inside MULTI yet");
    }
    let Some(numkeys) = parse_i64(&call.args[2]) else {
        return Outcome::error(super::NOT_INTEGER);
    };
    if numkeys < 0 {
        return Outcome::error("ERR Number of keys can't be negative");
    }
    if numkeys as u64 > (call.args.len() - 3) as u64 {
        return Outcome::error("ERR Number of keys can't be greater than number of args");
    }
    let numkeys = numkeys as usize;
    let keys: Vec<Vec<u8>> = call.args[3..3 + numkeys].to_vec();
    let argv: Vec<Vec<u8>> = call.args[3 + numkeys..].to_vec();
    let db = call.db();
    let shard = keys.first().map_or(0, |key| db.shard_of(key));
    // Lua sees the keys as the client wrote them (a long key's stored name is its surrogate).
    let names = super::names::current();
    let lua_keys: Vec<Vec<u8>> = keys
        .iter()
        .map(|key| match names.as_deref().and_then(|names| names.key_of(key)) {
            Some(original) => original.to_vec(),
            None => key.clone(),
        })
        .collect();
    let script = Script {
        server: call.server.clone(),
        sha,
        source,
        keys: lua_keys,
        argv,
        read_only,
        client: call.conn.info.clone(),
        db: call.conn.db,
    };
    let one_shard = keys.iter().all(|key| db.shard_of(key) == shard);
    let locks = lock_ids(&keys);
    let server = call.server.clone();
    Outcome::AfterPending(Box::pin(async move {
        if one_shard {
            let (answer, receiver) = oneshot::channel();
            let exec = ScriptExec {
                script: script.clone(),
                shard,
                locks: locks.clone(),
                cache: HashMap::new(),
                asked: Vec::new(),
                attempts: 0,
                started: None,
                result: None,
                publishes: Vec::new(),
                answer: Some(answer),
            };
            let request = ExecRequest { locks, exec: Box::new(exec) };
            server.db.exec_many_async(shard, vec![request]).await;
            match super::answered(receiver).await {
                Reply::Error(text) if text == SPREAD => {}
                reply => return reply,
            }
        }
        spread::run(&script).await
    }))
}

/// What a script run is: its source, arguments and caller (shared by both ways of running).
#[derive(Clone)]
struct Script {
    server: Arc<Server>,
    sha: String,
    source: Arc<[u8]>,
    keys: Vec<Vec<u8>>,
    argv: Vec<Vec<u8>>,
    read_only: bool,
    client: Arc<ClientInfo>,
    db: u8,
}

/// The answer of a script run in its keys' shard that touched a key outside its locks: it is
/// run again over all shards (`spread`), nothing of this run kept.
const SPREAD: &str = "\0copse: the script runs again over several shards";

/// One script run in its keys' shard (module comment).
struct ScriptExec {
    script: Script,
    shard: u32,
    locks: LockIds,
    /// The engine's answers to the reads earlier attempts stopped for.
    cache: HashMap<ReadOp, ReadResult>,
    /// The reads the last attempt stopped for, in the order asked of the engine.
    asked: Vec<ReadOp>,
    attempts: usize,
    started: Option<Instant>,
    /// The reply, held while the script's writes are made durable.
    result: Option<Reply>,
    /// PUBLISH and SPUBLISH the last attempt made (shard?, channel, message): delivered once the
    /// script's writes are durable, so no subscriber learns of a write a crash could undo.
    publishes: Vec<(bool, Vec<u8>, Vec<u8>)>,
    answer: Option<oneshot::Sender<Reply>>,
}

/// How an attempt ended.
enum Attempt {
    /// The script ran to its end: its reply and its writes.
    Ended(Reply, Overlay),
    /// A command needed these reads from the engine first.
    Stopped(Vec<ReadOp>),
    /// A command named a key outside the script's locks: run it over all shards instead.
    Spread,
}

/// Runs `f` with this thread's Lua state, made anew after a SCRIPT FLUSH.
fn with_vm<R>(server: &Server, f: impl FnOnce(&mut Vm) -> R) -> Result<R, Reply> {
    let generation = server.scripts_generation.load(std::sync::atomic::Ordering::Acquire);
    VM.with(|vm| {
        let mut vm = vm.borrow_mut();
        let vm = match vm.as_mut() {
            Some(vm) if vm.generation == generation => vm,
            _ => match Vm::new(generation) {
                Ok(made) => vm.insert(made),
                Err(err) => return Err(Reply::Error(format!("ERR {err}"))),
            },
        };
        Ok(f(vm))
    })
}

impl ScriptExec {
    fn finish(&mut self, reply: Reply) -> ExecStep {
        for (shard, channel, message) in std::mem::take(&mut self.publishes) {
            self.script.server.pubsub.publish(&channel, &message, shard);
        }
        if let Some(answer) = self.answer.take() {
            let _ = answer.send(reply);
        }
        ExecStep::Done
    }

    fn attempt_and_step(&mut self, view: &ExecView<'_>) -> ExecStep {
        self.attempts += 1;
        if self.attempts > SCRIPT_ATTEMPTS_MAX {
            self.publishes.clear();
            return self.finish(Reply::Error(format!(
                "ERR the script read from the store more than {SCRIPT_ATTEMPTS_MAX} times in sequence; nothing was written"
            )));
        }
        match self.attempt(view) {
            Attempt::Ended(reply, writes) if writes.is_empty() => self.finish(reply),
            Attempt::Spread => {
                self.publishes.clear();
                self.finish(Reply::Error(SPREAD.into()))
            }
            Attempt::Ended(reply, writes) => {
                if self.script.read_only {
                    return self.finish(Reply::error(
                        "ERR Write commands are not allowed from read-only scripts.",
                    ));
                }
                self.result = Some(reply);
                ExecStep::Write(overlay_ops(writes))
            }
            Attempt::Stopped(reads) => {
                let mut engine_reads = ReadOps::new();
                engine_reads.extend(reads.iter().cloned());
                self.asked = reads;
                ExecStep::Read(engine_reads)
            }
        }
    }

    fn attempt(&mut self, view: &ExecView<'_>) -> Attempt {
        let started = *self.started.get_or_insert_with(Instant::now);
        let server = self.script.server.clone();
        with_vm(&server, |vm| vm.run(self, view, started))
            .unwrap_or_else(|error| Attempt::Ended(error, Overlay::new()))
    }
}

impl Exec for ScriptExec {
    fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
        match input {
            StepInput::Start => self.attempt_and_step(view),
            StepInput::Read(Ok(results)) => {
                for (read, result) in std::mem::take(&mut self.asked).into_iter().zip(results) {
                    self.cache.insert(read, result);
                }
                self.attempt_and_step(view)
            }
            StepInput::Read(Err(err)) => {
                self.publishes.clear();
                self.finish(super::read_error(&err))
            }
            StepInput::Written(Ok(())) => {
                let reply = self.result.take().unwrap_or(Reply::Null);
                self.finish(reply)
            }
            StepInput::Written(Err(err)) => {
                self.publishes.clear();
                self.finish(super::write_error(&err))
            }
        }
    }
}

thread_local! {
    /// The Lua state of this thread's shards (execs run on their shard's thread).
    static VM: RefCell<Option<Vm>> = const { RefCell::new(None) };
}

/// A sandboxed Lua state and the scripts compiled in it.
struct Vm {
    lua: Lua,
    compiled: HashMap<String, mlua::Function>,
    /// Where `redis.call` and `redis.pcall` find the attempt's command function.
    hooks: Table,
    /// Runs a script under `pcall`: its error value comes back whole (a table or a string).
    runner: mlua::Function,
    /// `Server::scripts_generation` when made: SCRIPT FLUSH makes the next script build anew.
    generation: u64,
}

/// What `redis.call` needs while an attempt runs.
struct AttemptState<'a> {
    script: &'a mut ScriptExec,
    view: &'a ExecView<'a>,
    writes: Overlay,
    /// Reads a command needed that the cache does not hold: the attempt is over.
    missing: Vec<ReadOp>,
    conn: ConnState,
    publishes: Vec<(bool, Vec<u8>, Vec<u8>)>,
    /// A command named a key outside the script's locks (`Attempt::Spread`).
    spread: bool,
}

impl Vm {
    fn new(generation: u64) -> mlua::Result<Vm> {
        let lua =
            Lua::new_with(StdLib::TABLE | StdLib::STRING | StdLib::MATH, LuaOptions::default())?;
        lua.set_memory_limit(SCRIPT_MEMORY_BYTES_MAX)?;
        let redis = lua.create_table()?;
        // `{err = text}` and `{ok = text}`: what a script returns for an error or status reply.
        for (name, field) in [("error_reply", "err"), ("status_reply", "ok")] {
            let reply = lua.create_function(move |lua, text: mlua::LuaString| {
                let table = lua.create_table()?;
                table.set(field, text)?;
                Ok(table)
            })?;
            redis.set(name, reply)?;
        }
        redis.set(
            "sha1hex",
            lua.create_function(|_, text: mlua::LuaString| Ok(sha1_hex(&text.as_bytes())))?,
        )?;
        redis.set("log", lua.create_function(|_, _: MultiValue| Ok(()))?)?;
        redis.set("setresp", lua.create_function(|_, _: MultiValue| Ok(()))?)?;
        redis.set("set_repl", lua.create_function(|_, _: MultiValue| Ok(()))?)?;
        redis.set("replicate_commands", lua.create_function(|_, ()| Ok(true))?)?;
        redis.set("breakpoint", lua.create_function(|_, ()| Ok(false))?)?;
        for (name, level) in
            [("LOG_DEBUG", 0), ("LOG_VERBOSE", 1), ("LOG_NOTICE", 2), ("LOG_WARNING", 3)]
        {
            redis.set(name, level)?;
        }
        for (name, value) in [
            ("REPL_NONE", 0),
            ("REPL_AOF", 1),
            ("REPL_SLAVE", 2),
            ("REPL_REPLICA", 2),
            ("REPL_ALL", 3),
        ] {
            redis.set(name, value)?;
        }
        // The sandbox (Redis 7's, without its patched read-only tables): every run gets a fresh
        // global table whose functions and library tables are read-only proxies of the real
        // ones, so nothing a script does reaches the next one; no file, no environment access
        // (getfenv, setfenv, debug), no bytecode (`loadstring` refuses binary chunks and gives
        // what it loads the script's own environment); `pcall`/`xpcall` re-raise once the clock
        // stopped the script (`hooks.timed_out`), so it cannot be caught. `redis.call` raises a
        // command's error as Redis does (the error reply's table, which `pcall` hands back
        // whole); both reach the attempt's Rust side through `hooks`, set while an attempt runs.
        // The sandbox's own locals are out of the scripts' reach (no debug library).
        let hooks = lua.create_table()?;
        let runner: mlua::Function = lua
            .load(
                r#"
                local hooks, redis_impl = ...
                local pcall, xpcall, error, type, pairs, select, unpack = pcall, xpcall, error, type, pairs, select, unpack
                local setmetatable, getmetatable, getfenv, setfenv = setmetatable, getmetatable, getfenv, setfenv
                local loadstring, tostring, byte = loadstring, tostring, string.byte
                local string_lib, math_lib, table_lib = string, math, table
                -- The strings' metatable (its __index is the real string table) is hidden.
                getmetatable('').__metatable = false
                local function readonly(real)
                    return setmetatable({}, {
                        __index = real,
                        __newindex = function() error('Attempt to modify a readonly table', 2) end,
                        __metatable = false,
                    })
                end
                local function reraise_if_stopped(...)
                    if hooks.timed_out then error(hooks.timed_out, 0) end
                    return ...
                end
                local function safe_pcall(...) return reraise_if_stopped(pcall(...)) end
                local function safe_xpcall(...) return reraise_if_stopped(xpcall(...)) end
                local function safe_loadstring(source, name)
                    if type(source) == 'string' and byte(source, 1) == 27 then
                        return nil, 'binary chunks are not allowed'
                    end
                    local f, err = loadstring(source, name)
                    if f then setfenv(f, getfenv(2)) end
                    return f, err
                end
                local function call(...)
                    local reply = hooks.command(...)
                    if type(reply) == 'table' and reply.err ~= nil then error(reply, 0) end
                    return reply
                end
                local function pcall_command(...) return hooks.command(...) end
                local base = {
                    assert = assert, error = error, ipairs = ipairs, next = next, pairs = pairs,
                    pcall = safe_pcall, xpcall = safe_xpcall, rawequal = rawequal, rawget = rawget,
                    rawset = rawset, select = select, setmetatable = setmetatable,
                    getmetatable = getmetatable, tonumber = tonumber, tostring = tostring,
                    type = type, unpack = unpack, loadstring = safe_loadstring, _VERSION = _VERSION,
                }
                local function environment(keys, argv)
                    local redis = {}
                    for name, value in pairs(redis_impl) do redis[name] = value end
                    redis.call, redis.pcall = call, pcall_command
                    local env = {}
                    for name, value in pairs(base) do env[name] = value end
                    env.string, env.math, env.table = readonly(string_lib), readonly(math_lib), readonly(table_lib)
                    env.redis, env.KEYS, env.ARGV = readonly(redis), keys, argv
                    env._G = env
                    return setmetatable(env, {
                        __newindex = function() error('Attempt to modify a readonly table', 2) end,
                        __index = function(_, name)
                            error("Script attempted to access nonexistent global variable '"
                                .. tostring(name) .. "'", 2)
                        end,
                        __metatable = false,
                    })
                end
                return function(f, keys, argv)
                    setfenv(f, environment(keys, argv))
                    return pcall(f)
                end
                "#,
            )
            .set_name("=sandbox")
            .call((hooks.clone(), redis))?;
        Ok(Vm { lua, compiled: HashMap::new(), generation, hooks, runner })
    }

    /// Runs `script` once, its `redis.call`s answered by `command`: its reply, or None when the
    /// clock stopped it (`SCRIPT_TIME_MAX_MS` from `started`).
    fn execute(
        &mut self,
        script: &Script,
        started: Instant,
        command: &mut dyn FnMut(&Lua, MultiValue) -> mlua::Result<Value>,
    ) -> Option<Reply> {
        let function = match self.compiled.get(&script.sha) {
            Some(function) => function.clone(),
            None => match self.lua.load(&*script.source).set_name("@user_script").into_function() {
                Ok(function) => {
                    self.compiled.insert(script.sha.clone(), function.clone());
                    function
                }
                Err(err) => {
                    let text = format!(
                        "ERR Error compiling script (new function): {}",
                        lua_error_text(&err)
                    );
                    return Some(Reply::Error(text));
                }
            },
        };
        let lua = &self.lua;
        let deadline = started + Duration::from_millis(SCRIPT_TIME_MAX_MS);
        // Whether the clock stopped the script: then nothing it did is kept. The sandbox's
        // pcall re-raises once `hooks.timed_out` is set, so the script cannot catch it.
        let timed_out = std::rc::Rc::new(std::cell::Cell::new(false));
        let (timed_out_in_hook, hooks) = (timed_out.clone(), self.hooks.clone());
        if let Err(err) = self.hooks.raw_set("timed_out", Value::Nil) {
            return Some(Reply::Error(format!("ERR {err}")));
        }
        let hooked = lua.set_hook(
            mlua::HookTriggers::new().every_nth_instruction(SCRIPT_CLOCK_INSTRUCTIONS),
            move |_, _| {
                if Instant::now() >= deadline {
                    let text = "copse stopped the script: it ran longer than the time limit";
                    timed_out_in_hook.set(true);
                    hooks.raw_set("timed_out", text)?;
                    return Err(mlua::Error::RuntimeError(text.into()));
                }
                Ok(mlua::VmState::Continue)
            },
        );
        if let Err(err) = hooked {
            return Some(Reply::Error(format!("ERR {err}")));
        }
        let outcome = lua.scope(|scope| {
            let strings = |items: &[Vec<u8>]| -> mlua::Result<Table> {
                let items = items.iter().map(|item| lua.create_string(item));
                lua.create_sequence_from(items.collect::<mlua::Result<Vec<_>>>()?)
            };
            let (keys, argv) = (strings(&script.keys)?, strings(&script.argv)?);
            self.hooks
                .raw_set("command", scope.create_function_mut(|lua, args| command(lua, args))?)?;
            let (ok, value): (bool, Value) = self.runner.call((function.clone(), keys, argv))?;
            let reply = if ok { to_reply(&value) } else { script_error(&value, &script.sha) };
            self.hooks.raw_set("command", Value::Nil)?;
            Ok(reply)
        });
        lua.remove_hook();
        if timed_out.get() {
            return None;
        }
        Some(outcome.unwrap_or_else(|err| Reply::Error(format!("ERR {err}"))))
    }

    /// One attempt of a script in its keys' shard.
    fn run(&mut self, script: &mut ScriptExec, view: &ExecView<'_>, started: Instant) -> Attempt {
        let source = script.script.clone();
        let mut conn = ConnState::new(source.client.clone(), true);
        conn.select(source.db);
        conn.in_exec = true;
        let state = RefCell::new(AttemptState {
            script,
            view,
            writes: Overlay::new(),
            missing: Vec::new(),
            conn,
            publishes: Vec::new(),
            spread: false,
        });
        let reply = self.execute(&source, started, &mut |lua, args| command(lua, &state, args));
        let state = state.into_inner();
        // Only an attempt that ran to its end publishes (once its writes are durable).
        state.script.publishes = Vec::new();
        if state.spread {
            return Attempt::Spread;
        }
        if !state.missing.is_empty() {
            return Attempt::Stopped(state.missing);
        }
        match reply {
            Some(reply) => {
                state.script.publishes = state.publishes;
                Attempt::Ended(reply, state.writes)
            }
            None => Attempt::Ended(Reply::Error(timed_out_text()), Overlay::new()),
        }
    }
}

fn timed_out_text() -> String {
    format!("ERR copse stopped the script: it ran longer than {SCRIPT_TIME_MAX_MS} ms; nothing was written")
}

/// The marker error of an attempt stopped for reads: whatever the script does with it, the
/// attempt's effects are dropped.
const STOPPED_FOR_READS: &str = "copse: the script waits for a read and runs again";

/// `redis.pcall`, and `redis.call` before it raises an error reply: the command's reply as Lua
/// sees it (an error as `{err = text}`).
fn command(lua: &Lua, state: &RefCell<AttemptState<'_>>, args: MultiValue) -> mlua::Result<Value> {
    if !state.borrow().missing.is_empty() || state.borrow().spread {
        return Err(mlua::Error::RuntimeError(STOPPED_FOR_READS.into()));
    }
    let reply = match run_command(lua, state, args) {
        Ok(reply) => reply,
        Err(Stop::Reads) => return Err(mlua::Error::RuntimeError(STOPPED_FOR_READS.into())),
        Err(Stop::Spread) => {
            state.borrow_mut().spread = true;
            return Err(mlua::Error::RuntimeError(STOPPED_FOR_READS.into()));
        }
        Err(Stop::Refused(text)) => Reply::Error(text),
    };
    to_lua(lua, reply)
}

enum Stop {
    Reads,
    /// A key outside the script's locks.
    Spread,
    Refused(String),
}

fn run_command(
    lua: &Lua,
    state: &RefCell<AttemptState<'_>>,
    args: MultiValue,
) -> Result<Reply, Stop> {
    let mut words = crate::resp::Args::with_capacity(args.len());
    for arg in args {
        let bytes = match &arg {
            Value::String(text) => text.as_bytes().to_vec(),
            Value::Integer(_) | Value::Number(_) => match lua.coerce_string(arg.clone()) {
                Ok(Some(text)) => text.as_bytes().to_vec(),
                _ => {
                    return Err(refused(
                        "ERR Lua redis lib command arguments must be strings or integers",
                    ))
                }
            },
            _ => {
                return Err(refused(
                    "ERR Lua redis lib command arguments must be strings or integers",
                ))
            }
        };
        words.push(bytes);
    }
    if words.is_empty() {
        return Err(refused("ERR Please specify at least one argument for this redis lib call"));
    }
    let Some(spec) = find_ignoring_case(&words[0]) else {
        return Err(refused("ERR Unknown Redis command called from script"));
    };
    let count = words.len() as i32;
    if (spec.arity > 0 && count != spec.arity) || (spec.arity < 0 && count < -spec.arity) {
        return Err(refused("ERR Wrong number of args calling Redis command from script"));
    }
    if NOT_FROM_SCRIPTS.contains(&spec.name) || spec.flags.contains(&"blocking") {
        return Err(refused("ERR This Redis command is not allowed from script"));
    }
    let mut state = state.borrow_mut();
    let state = &mut *state;
    if state.script.script.read_only && spec.flags.contains(&"write") {
        return Err(refused("ERR Write commands are not allowed from read-only scripts."));
    }
    let server = state.script.script.server.clone();
    if spec.name == "publish" || spec.name == "spublish" {
        let shard = spec.name == "spublish";
        let receivers = server.pubsub.receivers(&words[1], shard);
        state.publishes.push((shard, words[1].clone(), words[2].clone()));
        return Ok(Reply::Integer(receivers as i64));
    }
    let outcome = dispatch(&server, &mut state.conn, words).outcome;
    let (queued, answers, combine) = match outcome {
        Outcome::Reply(reply) | Outcome::Close(reply) => return Ok(reply),
        Outcome::AfterPending(_) => {
            return Err(refused(&format!(
                "ERR copse cannot run {} from a script: it runs in steps of its own",
                spec.name.to_uppercase()
            )))
        }
        Outcome::Execs(Execs::One { queued, answer }) => (vec![queued], vec![answer], None),
        Outcome::Execs(Execs::Many { queued, answers, combine }) => {
            (queued, answers, Some(combine))
        }
    };
    let own = |queued: &Queued| {
        queued.shard == state.script.shard
            && queued.request.locks.iter().all(|lock| state.script.locks.contains(lock))
    };
    if !queued.iter().all(own) {
        return Err(Stop::Spread);
    }
    for queued in queued {
        run_inline(queued.request.exec, state)?;
    }
    let mut replies = Vec::with_capacity(answers.len());
    for mut answer in answers {
        replies.push(match answer.try_recv() {
            Ok(Some(reply)) => reply,
            _ => Reply::error("ERR internal error: a script's command did not answer"),
        });
    }
    Ok(match combine {
        Some(combine) => combine(replies),
        None => replies.pop().unwrap_or(Reply::Null),
    })
}

fn refused(text: &str) -> Stop {
    Stop::Refused(text.to_string())
}

/// Steps one command's exec to its end over the script's writes, its reads answered from the
/// overlay or the cache; stops the attempt at a read neither holds.
fn run_inline(mut exec: Box<dyn Exec>, state: &mut AttemptState<'_>) -> Result<(), Stop> {
    let mut input = StepInput::Start;
    loop {
        let step = exec.step(&state.view.with_overlay(&state.writes), input);
        input = match step {
            ExecStep::Done => return Ok(()),
            ExecStep::Write(ops) | ExecStep::WriteLast(ops) => {
                apply_to_overlay(&mut state.writes, ops);
                StepInput::Written(Ok(()))
            }
            ExecStep::Prepare { vote, .. } => {
                let refusal = copse::WriteError::Aborted("not from a script".into());
                vote.refuse(refusal.clone());
                StepInput::Written(Err(refusal))
            }
            ExecStep::Read(reads) => {
                let mut results = copse::exec::ReadResults::new();
                for read in reads {
                    match plan_read(&state.writes, read) {
                        Err(err) => {
                            return Err(Stop::Refused(format!("ERR {err}")));
                        }
                        Ok(OverlayRead::Local(result)) => results.push(result),
                        Ok(OverlayRead::Engine(read, scan)) => {
                            match state.script.cache.get(&read) {
                                Some(result) => results.push(merge_read(
                                    &state.writes,
                                    scan.as_ref(),
                                    result.clone(),
                                )),
                                None => {
                                    if !state.missing.contains(&read) {
                                        state.missing.push(read);
                                    }
                                }
                            }
                        }
                    }
                }
                if !state.missing.is_empty() {
                    return Err(Stop::Reads);
                }
                StepInput::Read(Ok(results))
            }
        };
    }
}

/// A command's reply as Lua sees it (Redis's conversion, RESP2 rules).
fn to_lua(lua: &Lua, reply: Reply) -> mlua::Result<Value> {
    Ok(match reply {
        Reply::Simple(text) => {
            let table = lua.create_table()?;
            table.set("ok", text.as_ref())?;
            Value::Table(table)
        }
        Reply::Error(text) => {
            let table = lua.create_table()?;
            table.set("err", text)?;
            Value::Table(table)
        }
        Reply::Integer(number) => Value::Number(number as f64),
        Reply::Bulk(bytes) => Value::String(lua.create_string(bytes)?),
        Reply::Null | Reply::NullArray => Value::Boolean(false),
        Reply::Array(items) | Reply::Set(items) | Reply::Push(items) | Reply::Frames(items) => {
            let table = lua.create_table()?;
            for (at, item) in items.into_iter().enumerate() {
                table.raw_set(at + 1, to_lua(lua, item)?)?;
            }
            Value::Table(table)
        }
        Reply::Map(pairs) => {
            let table = lua.create_table()?;
            let mut at = 1;
            for (key, value) in pairs {
                table.raw_set(at, to_lua(lua, key)?)?;
                table.raw_set(at + 1, to_lua(lua, value)?)?;
                at += 2;
            }
            Value::Table(table)
        }
        Reply::Double(number) => {
            Value::String(lua.create_string(crate::resp::format_double(number))?)
        }
        Reply::Verbatim { text, .. } | Reply::Encoded(text) => {
            Value::String(lua.create_string(text)?)
        }
    })
}

/// The script's return value as a reply (Redis's conversion).
fn to_reply(value: &Value) -> Reply {
    match value {
        Value::Nil | Value::Boolean(false) => Reply::Null,
        Value::Boolean(true) => Reply::Integer(1),
        Value::Integer(number) => Reply::Integer(*number),
        Value::Number(number) => Reply::Integer(*number as i64),
        Value::String(text) => Reply::Bulk(text.as_bytes().to_vec()),
        Value::Table(table) => {
            if let Ok(Value::String(error)) = table.raw_get::<Value>("err") {
                return Reply::Error(error.to_string_lossy());
            }
            if let Ok(Value::String(status)) = table.raw_get::<Value>("ok") {
                return Reply::Simple(status.to_string_lossy().into());
            }
            let mut items = Vec::new();
            let mut at = 1;
            loop {
                match table.raw_get::<Value>(at) {
                    Ok(Value::Nil) | Err(_) => break,
                    Ok(item) => items.push(to_reply(&item)),
                }
                at += 1;
            }
            Reply::Array(items)
        }
        _ => Reply::Null,
    }
}

/// The reply to a script that raised `error`: an error reply's table as it is, anything else as
/// Redis words it.
fn script_error(error: &Value, sha: &str) -> Reply {
    let suffix = format!("script: {sha}, on @user_script:1.");
    match error {
        Value::Table(table) => match table.raw_get::<Value>("err") {
            Ok(Value::String(text)) => Reply::Error(format!("{} {suffix}", text.to_string_lossy())),
            _ => Reply::Error(format!("ERR unknown error {suffix}")),
        },
        Value::String(text) => Reply::Error(format!("ERR {} {suffix}", text.to_string_lossy())),
        other => {
            let text = other.to_string().unwrap_or_default();
            let text = text.lines().next().unwrap_or_default();
            Reply::Error(format!("ERR {text} {suffix}"))
        }
    }
}

/// A Lua error's message without mlua's traceback.
fn lua_error_text(err: &mlua::Error) -> String {
    match err {
        mlua::Error::RuntimeError(text) | mlua::Error::SyntaxError { message: text, .. } => {
            text.lines().next().unwrap_or_default().to_string()
        }
        mlua::Error::CallbackError { cause, .. } => lua_error_text(cause),
        other => other.to_string().lines().next().unwrap_or_default().to_string(),
    }
}

/// A script over keys of several shards, or one that named a key it did not declare: run on the
/// connection's thread with optimistic concurrency. Each `redis.call` is tried in its shard by a
/// `Probe` (under the command's locks, over the script's writes so far in that shard, writing
/// nothing), which notes the versions of the locks it held; the script runs again from its start
/// after each probe, the answers kept (as in the shard mode). When it ends, its writes go out
/// as one cross-shard batch of sequences that first check every noted version under the locks
/// (`multi::run`): a key changed since its probe calls the batch off, and the whole script runs
/// again (at most `SCRIPT_SPREAD_ATTEMPTS_MAX` times). So the script is serializable at its
/// batch's commit, and atomic across shards and a crash.
pub(crate) mod spread {
    use std::collections::BTreeMap;

    use copse::exec::{apply_to_overlay, LockIds, Overlay, ReadResults};
    use copse::BatchOp;

    use super::*;
    use crate::cmd::multi::{self, ShardShare};

    /// Runs of a spread script whose checked versions moved before it gives up.
    pub const SCRIPT_SPREAD_ATTEMPTS_MAX: usize = 100;

    /// One `redis.call` and what it found.
    struct Call {
        args: Vec<Vec<u8>>,
        reply: Reply,
    }

    /// What the calls so far found and did, per shard.
    #[derive(Default)]
    struct Shard {
        writes: Overlay,
        /// The locks of the calls that wrote here.
        written_locks: LockIds,
        locks: LockIds,
        /// (lock, version when first probed).
        versions: Vec<(u64, u64)>,
    }

    pub(super) async fn run(script: &Script) -> Reply {
        for _ in 0..SCRIPT_SPREAD_ATTEMPTS_MAX {
            let mut session = Session::new(script.server.clone());
            let reply = session.script(script).await;
            if session.stopped {
                return reply;
            }
            if session.diverged {
                continue;
            }
            match session.commit(None).await {
                Ok(true) => return reply,
                Ok(false) => continue,
                Err(error) => return error,
            }
        }
        called_off()
    }

    fn called_off() -> Reply {
        Reply::Error(format!(
            "ERR the keys kept changing under the script: {SCRIPT_SPREAD_ATTEMPTS_MAX} runs were called off; nothing was written"
        ))
    }

    /// A MULTI ... EXEC that holds a script, run optimistically as one session: each command
    /// and each script's calls probed in order, one batch at the end that checks every version
    /// seen and the watched ones. None: a watched key changed (EXEC answers nil).
    pub async fn transaction(
        server: &Arc<Server>,
        client: Arc<ClientInfo>,
        db: u8,
        queued: Vec<crate::resp::Args>,
        watched: Vec<crate::context::WatchedKey>,
        check: Arc<dyn Fn() -> bool + Send + Sync>,
    ) -> Option<(Reply, u8)> {
        for _ in 0..SCRIPT_SPREAD_ATTEMPTS_MAX {
            let mut session = Session::new(server.clone());
            let mut caller = Caller { client: client.clone(), db, read_only: false };
            let mut replies = Vec::with_capacity(queued.len());
            for args in &queued {
                replies.push(session.transaction_command(&mut caller, args).await);
                if session.stopped {
                    // A script stopped by the clock: nothing of the transaction is written.
                    return Some((Reply::Error(timed_out_text()), db));
                }
                if session.diverged {
                    break;
                }
            }
            if session.diverged {
                continue;
            }
            let watched_now = watched.iter().map(|key| (key.shard, key.lock, key.version));
            match session.commit_checking(watched_now.collect(), Some(check.clone())).await {
                Ok(true) => return Some((Reply::Array(replies), caller.db)),
                Ok(false) => {
                    // Called off: by a watched key (EXEC answers nil) or by a probed one (again).
                    if !check() || session.watched_moved(&watched).await {
                        return None;
                    }
                }
                Err(error) => return Some((error, db)),
            }
        }
        Some((called_off(), db))
    }

    /// Who runs the commands of a session: the client, its database, and whether writes are
    /// refused (EVAL_RO).
    struct Caller {
        client: Arc<ClientInfo>,
        db: u8,
        read_only: bool,
    }

    /// What a session's calls found and did so far.
    struct Session {
        server: Arc<Server>,
        shards: BTreeMap<u32, Shard>,
        publishes: Vec<(bool, Vec<u8>, Vec<u8>)>,
        started: Instant,
        /// A script was stopped by its time limit: nothing is written.
        stopped: bool,
        /// A script's run asked for other calls than the run before (TIME, random): the
        /// session's probes no longer match what the script does; it starts over.
        diverged: bool,
        /// `Server::flush_epoch` and `swap_epoch` at the start: a FLUSHALL, FLUSHDB or SWAPDB
        /// changes keys without their locks, so one since calls the commit off.
        epochs: (u64, u64),
    }

    impl Session {
        fn new(server: Arc<Server>) -> Session {
            let started = Instant::now();
            let epochs = epochs_of(&server);
            Session {
                server,
                shards: BTreeMap::new(),
                publishes: Vec::new(),
                started,
                stopped: false,
                diverged: false,
                epochs,
            }
        }

        /// Runs `script`, its calls probed (answers kept across its runs from its start).
        async fn script(&mut self, script: &Script) -> Reply {
            let mut calls: Vec<Call> = Vec::new();
            loop {
                // Run the script with the calls answered so far; it stops at the next one. A
                // SELECT it makes holds for its calls after it, from each run's start.
                let mut caller = Caller {
                    client: script.client.clone(),
                    db: script.db,
                    read_only: script.read_only,
                };
                let mut next: Option<Vec<Vec<u8>>> = None;
                let mut at = 0;
                let mut diverged = false;
                let answered = with_vm(&script.server, |vm| {
                    vm.execute(script, self.started, &mut |lua, args| {
                        if next.is_some() || diverged {
                            return Err(mlua::Error::RuntimeError(STOPPED_FOR_READS.into()));
                        }
                        let words = match words_of(lua, args) {
                            Ok(words) => words,
                            Err(text) => return to_lua(lua, Reply::Error(text)),
                        };
                        match calls.get(at) {
                            Some(call) if call.args == words => {
                                at += 1;
                                if let Some(db) = selected_db(&words) {
                                    caller.db = db;
                                }
                                to_lua(lua, call.reply.clone())
                            }
                            Some(_) => {
                                diverged = true;
                                Err(mlua::Error::RuntimeError(STOPPED_FOR_READS.into()))
                            }
                            None => {
                                next = Some(words);
                                Err(mlua::Error::RuntimeError(STOPPED_FOR_READS.into()))
                            }
                        }
                    })
                });
                let answered = match answered {
                    Ok(answered) => answered,
                    Err(error) => return error,
                };
                if diverged || (next.is_none() && at < calls.len()) {
                    // The probes made for the calls this run did not repeat would still count.
                    self.diverged = true;
                    return Reply::Null;
                }
                let Some(words) = next else {
                    if answered.is_none() {
                        self.stopped = true;
                    }
                    return answered.unwrap_or_else(|| Reply::Error(timed_out_text()));
                };
                if self.started.elapsed() >= Duration::from_millis(SCRIPT_TIME_MAX_MS) {
                    self.stopped = true;
                    return Reply::Error(timed_out_text());
                }
                let reply =
                    self.call(&mut caller, &words, true).await.unwrap_or_else(|error| error);
                calls.push(Call { args: words, reply });
            }
        }

        /// One queued command of a transaction run as a session.
        async fn transaction_command(
            &mut self,
            caller: &mut Caller,
            args: &crate::resp::Args,
        ) -> Reply {
            let name = String::from_utf8_lossy(&args[0]).to_ascii_lowercase();
            match name.as_str() {
                "select" => match parse_i64(&args[1]) {
                    Some(db) if (0..crate::cmd::namespace::DATABASES as i64).contains(&db) => {
                        caller.db = db as u8;
                        Reply::ok()
                    }
                    _ => Reply::error("ERR DB index is out of range"),
                },
                "eval" | "evalsha" | "eval_ro" | "evalsha_ro" => {
                    match self.script_of(caller, args, &name) {
                        Ok(script) => self.script(&script).await,
                        Err(error) => error,
                    }
                }
                _ => {
                    let words: Vec<Vec<u8>> = args.iter().cloned().collect();
                    self.call(caller, &words, false).await.unwrap_or_else(|error| error)
                }
            }
        }

        /// The script an EVAL or EVALSHA of a transaction names.
        fn script_of(
            &self,
            caller: &Caller,
            args: &crate::resp::Args,
            name: &str,
        ) -> Result<Script, Reply> {
            let server = &self.server;
            let source: Arc<[u8]> = if name.starts_with("evalsha") {
                let sha = String::from_utf8_lossy(&args[1]).to_ascii_lowercase();
                let scripts = server.scripts.lock().unwrap_or_else(|p| p.into_inner());
                scripts
                    .get(&sha)
                    .cloned()
                    .ok_or_else(|| Reply::error("NOSCRIPT No matching script. Please use EVAL."))?
            } else {
                let source: Arc<[u8]> = args[1].clone().into();
                let sha = sha1_hex(&source);
                server
                    .scripts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(sha, source.clone());
                source
            };
            let numkeys =
                parse_i64(&args[2]).ok_or_else(|| Reply::error(crate::cmd::NOT_INTEGER))?;
            if numkeys < 0 || numkeys as u64 > (args.len() - 3) as u64 {
                return Err(Reply::error(
                    "ERR Number of keys can't be greater than number of args",
                ));
            }
            let numkeys = numkeys as usize;
            Ok(Script {
                server: server.clone(),
                sha: sha1_hex(&source),
                source,
                keys: args[3..3 + numkeys].to_vec(),
                argv: args[3 + numkeys..].to_vec(),
                read_only: name.ends_with("_ro"),
                client: caller.client.clone(),
                db: caller.db,
            })
        }

        /// Writes the session's effects as one batch checking every version its probes saw.
        async fn commit(
            &mut self,
            check: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
        ) -> Result<bool, Reply> {
            self.commit_checking(Vec::new(), check).await
        }

        /// `commit`, also checking `watched` (shard, lock, version).
        async fn commit_checking(
            &mut self,
            watched: Vec<(u32, u64, u64)>,
            check: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
        ) -> Result<bool, Reply> {
            for (shard, lock, version) in watched {
                let shard = self.shards.entry(shard).or_default();
                shard.locks.push(lock);
                shard.versions.push((lock, version));
            }
            let shares: BTreeMap<u32, ShardShare> = std::mem::take(&mut self.shards)
                .into_iter()
                .map(|(id, shard)| {
                    let ops = copse::exec::overlay_ops(shard.writes);
                    let steps: Vec<(Box<dyn Exec>, LockIds)> = if ops.is_empty() {
                        Vec::new()
                    } else {
                        vec![(
                            Box::new(WriteOps { ops: Some(ops) }) as Box<dyn Exec>,
                            shard.written_locks,
                        )]
                    };
                    (id, ShardShare::new(steps, shard.locks, shard.versions))
                })
                .collect();
            let epochs = self.epochs;
            let server = self.server.clone();
            let outside: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || {
                epochs_of(&server) == epochs && check.as_ref().is_none_or(|check| check())
            });
            let applied = multi::run(&self.server, shares, Some(outside)).await?;
            if applied {
                for (shard, channel, message) in std::mem::take(&mut self.publishes) {
                    self.server.pubsub.publish(&channel, &message, shard);
                }
            }
            Ok(applied)
        }

        /// Whether a watched key's lock version is no longer what WATCH read.
        async fn watched_moved(&self, watched: &[crate::context::WatchedKey]) -> bool {
            for key in watched {
                let (report, reported) = oneshot::channel();
                let probe = Probe {
                    inner: Box::new(WriteOps { ops: None }),
                    locks: std::iter::once(key.lock).collect(),
                    overlay: Overlay::new(),
                    versions: Vec::new(),
                    writes: Vec::new(),
                    planned: None,
                    client_versions: true,
                    report: Some(report),
                };
                let request = ExecRequest {
                    locks: std::iter::once(key.lock).collect(),
                    exec: Box::new(probe),
                };
                self.server.db.exec_many_async(key.shard, vec![request]).await;
                match reported.await {
                    Ok((versions, _))
                        if versions.iter().all(|&(_, version)| version == key.version) => {}
                    _ => return true,
                }
            }
            false
        }
    }

    /// The database a SELECT call names, if the call is a valid SELECT.
    fn selected_db(words: &[Vec<u8>]) -> Option<u8> {
        let [name, db] = words else { return None };
        if !name.eq_ignore_ascii_case(b"select") {
            return None;
        }
        parse_i64(db)
            .filter(|&db| (0..crate::cmd::namespace::DATABASES as i64).contains(&db))
            .map(|db| db as u8)
    }

    fn epochs_of(server: &Server) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        (server.flush_epoch.load(Ordering::Acquire), server.swap_epoch.load(Ordering::Acquire))
    }

    /// A `redis.call`'s arguments as bytes, or the error Lua gets.
    fn words_of(lua: &Lua, args: MultiValue) -> Result<Vec<Vec<u8>>, String> {
        let mut words = Vec::with_capacity(args.len());
        for arg in args {
            let bytes = match &arg {
                Value::String(text) => text.as_bytes().to_vec(),
                Value::Integer(_) | Value::Number(_) => match lua.coerce_string(arg.clone()) {
                    Ok(Some(text)) => text.as_bytes().to_vec(),
                    _ => {
                        return Err(
                            "ERR Lua redis lib command arguments must be strings or integers"
                                .into(),
                        )
                    }
                },
                _ => {
                    return Err(
                        "ERR Lua redis lib command arguments must be strings or integers".into()
                    )
                }
            };
            words.push(bytes);
        }
        Ok(words)
    }

    impl Session {
        /// Tries one command in its shards (`Probe`), over the session's writes there.
        async fn call(
            &mut self,
            caller: &mut Caller,
            words: &[Vec<u8>],
            from_lua: bool,
        ) -> Result<Reply, Reply> {
            let (shards, publishes) = (&mut self.shards, &mut self.publishes);
            if words.is_empty() {
                return Err(Reply::error(
                    "ERR Please specify at least one argument for this redis lib call",
                ));
            }
            let Some(spec) = find_ignoring_case(&words[0]) else {
                return Err(Reply::error("ERR Unknown Redis command called from script"));
            };
            let count = words.len() as i32;
            if (spec.arity > 0 && count != spec.arity) || (spec.arity < 0 && count < -spec.arity) {
                return Err(Reply::error(
                    "ERR Wrong number of args calling Redis command from script",
                ));
            }
            if from_lua
                && (NOT_FROM_SCRIPTS.contains(&spec.name) || spec.flags.contains(&"blocking"))
            {
                return Err(Reply::error("ERR This Redis command is not allowed from script"));
            }
            if let Some(db) = selected_db(words) {
                caller.db = db;
                return Ok(Reply::ok());
            }
            if caller.read_only && spec.flags.contains(&"write") {
                return Err(Reply::error(
                    "ERR Write commands are not allowed from read-only scripts.",
                ));
            }
            let server = &self.server;
            if spec.name == "publish" || spec.name == "spublish" {
                let shard = spec.name == "spublish";
                publishes.push((shard, words[1].clone(), words[2].clone()));
                return Ok(Reply::Integer(server.pubsub.receivers(&words[1], shard) as i64));
            }
            let mut conn = ConnState::new(caller.client.clone(), true);
            conn.select(caller.db);
            conn.in_exec = true;
            let args: crate::resp::Args = words.iter().cloned().collect();
            let outcome = dispatch(server, &mut conn, args).outcome;
            let (queued, answers, combine) = match outcome {
                Outcome::Reply(reply) | Outcome::Close(reply) => return Ok(reply),
                Outcome::AfterPending(_) => {
                    return Err(Reply::Error(format!(
                        "ERR copse cannot run {} from a script: it runs in steps of its own",
                        spec.name.to_uppercase()
                    )))
                }
                Outcome::Execs(Execs::One { queued, answer }) => (vec![queued], vec![answer], None),
                Outcome::Execs(Execs::Many { queued, answers, combine }) => {
                    (queued, answers, Some(combine))
                }
            };
            for queued in queued {
                let shard = shards.entry(queued.shard).or_default();
                let (report, reported) = oneshot::channel();
                let locks = queued.request.locks.clone();
                let probe = Probe {
                    inner: queued.request.exec,
                    locks: locks.clone(),
                    overlay: shard.writes.clone(),
                    versions: Vec::new(),
                    writes: Vec::new(),
                    planned: None,
                    client_versions: false,
                    report: Some(report),
                };
                let request = ExecRequest { locks: locks.clone(), exec: Box::new(probe) };
                server.db.exec_many_async(queued.shard, vec![request]).await;
                let Ok((versions, writes)) = reported.await else {
                    return Err(Reply::error("ERR the store is closed"));
                };
                for (lock, version) in versions {
                    match shard.versions.iter().find(|(seen, _)| *seen == lock) {
                        // Changed since the script's earlier call: this run cannot commit.
                        Some(&(_, first)) if first != version => {
                            shard.versions.push((lock, u64::MAX))
                        }
                        Some(_) => {}
                        None => shard.versions.push((lock, version)),
                    }
                }
                shard.locks.extend_from_slice(&locks);
                if !writes.is_empty() {
                    shard.written_locks.extend_from_slice(&locks);
                    apply_to_overlay(&mut shard.writes, writes);
                }
            }
            let mut replies = Vec::with_capacity(answers.len());
            for answer in answers {
                replies.push(crate::cmd::answered(answer).await);
            }
            Ok(match combine {
                Some(combine) => combine(replies),
                None => replies.pop().unwrap_or(Reply::Null),
            })
        }
    }

    /// A probed step's read: answered by the overlay, or by the engine's read at this position
    /// (a scan with the overlay to lay over it).
    type PlannedRead = Result<ReadResult, (usize, Option<copse::exec::ScanOver>)>;

    /// What a probe found: the versions of the locks it held, and what its command would write.
    type ProbeReport = (Vec<(u64, u64)>, Vec<BatchOp>);

    /// Runs a command's exec in its shard over `overlay` without writing: notes the versions of
    /// its locks and what it would write.
    struct Probe {
        inner: Box<dyn Exec>,
        locks: LockIds,
        overlay: Overlay,
        versions: Vec<(u64, u64)>,
        writes: Vec<BatchOp>,
        /// The inner step's reads: answered locally, or by the engine read at `at`.
        planned: Option<Vec<PlannedRead>>,
        /// Note versions as clients see them (WATCH's), not all writes (a script's reads).
        client_versions: bool,
        report: Option<oneshot::Sender<ProbeReport>>,
    }

    impl Probe {
        fn drive(&mut self, view: &ExecView<'_>, mut input: StepInput) -> ExecStep {
            loop {
                match self.inner.step(&view.with_overlay(&self.overlay), input) {
                    ExecStep::Done => {
                        if let Some(report) = self.report.take() {
                            let _ = report.send((
                                std::mem::take(&mut self.versions),
                                std::mem::take(&mut self.writes),
                            ));
                        }
                        return ExecStep::Done;
                    }
                    ExecStep::Write(ops) | ExecStep::WriteLast(ops) => {
                        self.writes.extend(ops.iter().cloned());
                        apply_to_overlay(&mut self.overlay, ops);
                        input = StepInput::Written(Ok(()));
                    }
                    ExecStep::Prepare { vote, .. } => {
                        let refusal = copse::WriteError::Aborted("not from a script".into());
                        vote.refuse(refusal.clone());
                        input = StepInput::Written(Err(refusal));
                    }
                    ExecStep::Read(reads) => {
                        let mut planned = Vec::with_capacity(reads.len());
                        let mut engine = ReadOps::new();
                        let mut refused = None;
                        for read in reads {
                            match plan_read(&self.overlay, read) {
                                Err(err) => {
                                    refused = Some(err);
                                    break;
                                }
                                Ok(OverlayRead::Local(result)) => planned.push(Ok(result)),
                                Ok(OverlayRead::Engine(read, scan)) => {
                                    planned.push(Err((engine.len(), scan)));
                                    engine.push(read);
                                }
                            }
                        }
                        if let Some(err) = refused {
                            input = StepInput::Read(Err(err.into()));
                            continue;
                        }
                        if engine.is_empty() {
                            let results = planned.into_iter().filter_map(Result::ok).collect();
                            input = StepInput::Read(Ok(results));
                            continue;
                        }
                        self.planned = Some(planned);
                        return ExecStep::Read(engine);
                    }
                }
            }
        }
    }

    impl Exec for Probe {
        fn step(&mut self, view: &ExecView<'_>, input: StepInput) -> ExecStep {
            match input {
                StepInput::Start => {
                    self.versions = if self.client_versions {
                        self.locks.iter().map(|&lock| (lock, view.lock_version(lock))).collect()
                    } else {
                        self.locks
                            .iter()
                            .map(|&lock| {
                                (lock, view.lock_version_all(lock) | copse::exec::COUNTS_BACKGROUND)
                            })
                            .collect()
                    };
                    self.drive(view, StepInput::Start)
                }
                StepInput::Read(Ok(results)) => {
                    let mut engine: Vec<Option<ReadResult>> =
                        results.into_iter().map(Some).collect();
                    let planned = self.planned.take().unwrap_or_default();
                    let merged: ReadResults = planned
                        .into_iter()
                        .map(|read| match read {
                            Ok(local) => local,
                            Err((at, scan)) => {
                                let result = engine[at].take().expect("one answer per engine read");
                                merge_read(&self.overlay, scan.as_ref(), result)
                            }
                        })
                        .collect();
                    self.drive(view, StepInput::Read(Ok(merged)))
                }
                other => self.drive(view, other),
            }
        }
    }

    /// The batch of a spread script's writes in one shard: one step of its sequence.
    struct WriteOps {
        ops: Option<Vec<BatchOp>>,
    }

    impl Exec for WriteOps {
        fn step(&mut self, _view: &ExecView<'_>, input: StepInput) -> ExecStep {
            match (input, self.ops.take()) {
                (StepInput::Start, Some(ops)) => ExecStep::Write(ops),
                _ => ExecStep::Done,
            }
        }
    }
}
