//! End to end with real processes: three `gangway controller` processes, two
//! `gangway agent` processes, and the `gangway` CLI as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const GANGWAY: &str = env!("CARGO_BIN_EXE_gangway");
/// Bound on every wait here: far above what a healthy run needs.
const WAIT: Duration = Duration::from_secs(60);

/// Child processes killed (SIGKILL) when the test ends, however it ends.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The e2e clusters' CA and certificates (replicas 1-3, agents e2e-node-1..3,
/// users root and mallory), made once with `gangway tls` as a site would.
fn pki() -> &'static Path {
    static PKI: OnceLock<PathBuf> = OnceLock::new();
    PKI.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let tls = dir.join("tls");
        let run = |args: &[&str]| {
            let o = Command::new(GANGWAY).args(args).stdin(Stdio::null()).output().unwrap();
            assert!(o.status.success(), "gangway {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        };
        let d = tls.to_str().unwrap();
        run(&["tls", "ca", "create", "--dir", d]);
        for id in ["1", "2", "3"] {
            // Host names for tools that check them (curl, browsers: the console).
            run(&["tls", "cert", "create", "--server", id, "--ca-dir", d, "--host", "127.0.0.1"]);
        }
        for n in ["e2e-node-1", "e2e-node-2", "e2e-node-3", "e2e-cloud-1"] {
            run(&["tls", "cert", "create", "--agent", n, "--ca-dir", d]);
        }
        for user in ["root", "mallory", "nobody", "accounting"] {
            run(&["tls", "cert", "create", "--client", user, "--ca-dir", d]);
        }
        tls
    })
}

/// A CLI command as `user` of the e2e clusters (its client certificate).
fn as_user<'a>(c: &'a mut Command, user: &str) -> &'a mut Command {
    let d = pki();
    c.env("GANGWAY_TLS_CA", d.join("ca.pem"))
        .env("GANGWAY_TLS_CERT", d.join(format!("client-{user}.pem")))
        .env("GANGWAY_TLS_KEY", d.join(format!("client-{user}-key.pem")))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn(args: &[&str], log: &Path) -> Child {
    spawn_exe(Path::new(GANGWAY), args, log)
}

fn spawn_exe(exe: &Path, args: &[&str], log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(exe).args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn().unwrap()
}

/// The `gangway` binary where every user can run it, as an installed one is
/// (/usr/local/bin): agents link the Slurm commands in jobs' PATH to their own
/// binary, and the build's is under a home directory others cannot enter.
/// Removed with the returned directory.
fn agent_bin() -> (tempfile::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix("gangway-e2e-bin-").tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.path().join("gangway");
    if std::fs::hard_link(GANGWAY, &exe).is_err() {
        std::fs::copy(GANGWAY, &exe).unwrap();
    }
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, exe)
}

/// `gangway agent` arguments for test node `n` (state under `dir`).
fn agent_args(endpoints: &str, n: usize, dir: &Path) -> Vec<String> {
    named_agent_args(endpoints, &format!("e2e-node-{n}"), &dir.join(format!("agent-{n}")))
}

fn named_agent_args(endpoints: &str, name: &str, state: &Path) -> Vec<String> {
    let state = state.display().to_string();
    ["agent", "--controllers", endpoints, "--name", name, "--fake-gpus", "4xh100-80gb", "--state-dir", &state]
        .into_iter()
        .chain(["--addr", "127.0.0.1", "--step-listen", "127.0.0.1:0"])
        .chain(["--tls-dir", pki().to_str().unwrap(), "--allow-root-jobs", "--constrain-devices"])
        .map(str::to_string)
        .collect()
}

fn cli(endpoints: &str, args: &[&str], cwd: &Path) -> Output {
    as_user(Command::new(GANGWAY).args(args), "root")
        .env("GANGWAY_ENDPOINTS", endpoints)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// A CLI command against the dev cluster, finding its certificates itself as
/// a user's would.
fn dev_cli(endpoints: &str, args: &[&str], cwd: &Path) -> Output {
    Command::new(GANGWAY)
        .args(args)
        .env("GANGWAY_ENDPOINTS", endpoints)
        .env_remove("GANGWAY_TLS_DIR")
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn controllers_agents_and_cli_as_separate_processes() {
    let (_agent_bin, agent_exe) = agent_bin();
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let (addrs, peers, endpoints) = three_replicas();
    let mut procs = Procs(Vec::new());
    let (_pool_agent, programs) = pool_programs(&agent_exe, &endpoints, dir.path());
    let console = format!("127.0.0.1:{}", free_port());
    for (i, addr) in addrs.iter().enumerate() {
        let data = dir.path().join(format!("c{}", i + 1));
        let id = (i + 1).to_string();
        let tls = pki().to_str().unwrap();
        let args = [
            "controller",
            "--id",
            &id,
            "--listen",
            addr,
            "--peers",
            &peers,
            "--data-dir",
            data.to_str().unwrap(),
            "--tls-dir",
            tls,
            "--bootstrap-admin",
            "root",
            "--allow-root-jobs",
            "--resume-program",
            programs[0].to_str().unwrap(),
            "--suspend-program",
            programs[1].to_str().unwrap(),
        ];
        let mut args = args.to_vec();
        if i == 0 {
            args.extend(["--ui-listen", console.as_str()]);
        }
        procs.0.push(spawn(&args, &dir.path().join(format!("c{}.log", i + 1))));
    }
    for n in 1..=2 {
        let args = agent_args(&endpoints, n, dir.path());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        procs.0.push(spawn_exe(&agent_exe, &args, &dir.path().join(format!("a{n}.log"))));
    }
    // Both nodes registered, seen through the CLI.
    eventually("agents never registered", || {
        let o = cli(&endpoints, &["nodes", "--json"], &work);
        o.status.success() && stdout(&o).matches("\"state\": \"UP\"").count() == 2
    });
    // `gangway doctor` on this host: the controllers reachable, every
    // certificate valid, the disk's fsync timed; an unreachable one fails it.
    let doctor = |eps: &str| {
        Command::new(GANGWAY)
            .args(["doctor", "--data-dir", work.to_str().unwrap(), "--tls-dir", pki().to_str().unwrap()])
            .env("GANGWAY_ENDPOINTS", eps)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let o = doctor(&endpoints);
    let said = stdout(&o);
    assert!(o.status.success(), "{said}{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(said.matches("ok    controller").count(), 3, "{said}");
    // The same machine's clock: within a few milliseconds of every replica's.
    assert_eq!(said.matches("ok    clock").count(), 3, "{said}");
    assert!(said.contains(" ms against this host (±"), "{said}");
    assert!(said.contains("ok    certificate   server:1: valid for"), "{said}");
    assert!(said.contains("fsync in") && said.contains("p99"), "{said}");
    let o = doctor(&format!("{endpoints},127.0.0.1:1"));
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("FAIL  controller    127.0.0.1:1"), "{}", stdout(&o));
    // The web console over HTTPS with the replica's certificate: a browser's
    // client certificate is its user; no certificate (or another role's)
    // and no session must log in, and this cluster takes no bearer tokens.
    // (The pages themselves are checked in Chromium by `make console-check`.)
    let curl = |args: &[&str]| {
        let ca = pki().join("ca.pem");
        let o = Command::new("curl")
            .args(["-sS", "--max-time", "10", "--cacert", ca.to_str().unwrap()])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "curl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let cert = |stem: &str| {
        let d = pki();
        let file = |f: String| d.join(f).to_str().unwrap().to_string();
        ["--cert".to_string(), file(format!("{stem}.pem")), "--key".to_string(), file(format!("{stem}-key.pem"))]
    };
    let base = format!("https://{console}");
    assert!(curl(&[&format!("{base}/ui/")]).contains("<title>Gangway</title>"));
    let [c, cf, k, kf] = cert("client-mallory");
    let me = curl(&[&c, &cf, &k, &kf, &format!("{base}/ui/api/whoami")]);
    assert!(me.contains("\"identity\":\"client:mallory\"") && me.contains("\"admin\":false"), "{me}");
    let anon = curl(&["-i", &format!("{base}/ui/api/whoami")]);
    assert!(anon.starts_with("HTTP/1.1 401") && anon.contains("\"login\":\"token\""), "{anon}");
    let [c, cf, k, kf] = cert("server-2");
    let server = curl(&["-i", &c, &cf, &k, &kf, &format!("{base}/ui/api/jobs")]);
    assert!(server.starts_with("HTTP/1.1 401"), "a server certificate is nobody in the console: {server}");
    let login =
        curl(&["-i", "-H", "x-gangway-csrf: 1", "--data", "{\"token\":\"abc.def.ghi\"}", &format!("{base}/ui/login")]);
    assert!(login.starts_with("HTTP/1.1 400") && login.contains("accepts no bearer tokens"), "{login}");
    // A bad submission: one line on stderr, exit code 1, nothing created.
    let bad = cli(&endpoints, &["submit", "-N", "0", "--", "true"], &work);
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("--nodes: '0' must be N or MIN-MAX with N >= 1"), "{err}");
    // A 2-node gang job through the CLI, run by the agent processes.
    let o = cli(
        &endpoints,
        &[
            "submit",
            "--parsable",
            "-N",
            "2",
            "--gpus-per-node",
            "h100:2",
            "--",
            "sh",
            "-c",
            "echo rank=$RANK nodes=$SLURM_JOB_NODELIST",
        ],
        &work,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    eventually("the gang job never completed", || {
        let o = cli(&endpoints, &["show", &id, "--json"], &work);
        stdout(&o).contains("\"state\": \"COMPLETED\"")
    });
    let rank0 = std::fs::read_to_string(work.join(format!("slurm-{id}.out"))).unwrap();
    let rank1 = std::fs::read_to_string(work.join(format!("slurm-{id}.1.out"))).unwrap();
    assert_eq!(rank0.trim(), "rank=0 nodes=e2e-node-[1-2]");
    assert_eq!(rank1.trim(), "rank=1 nodes=e2e-node-[1-2]");
    ordinary_users_jobs_run_as_them(&endpoints, dir.path());
    // The queue and cluster status read as tables.
    let q = stdout(&cli(&endpoints, &["queue", "--all"], &work));
    assert!(q.starts_with("JOBID") && q.contains("COMPLETED"), "{q}");
    let st = stdout(&cli(&endpoints, &["cluster", "status"], &work));
    assert!(st.matches("leader").count() >= 2, "{st}");
    assert_eq!(st.matches("follower").count(), 2, "{st}");
    let newest = format!("format: {}", gangway_core::format::FORMAT_NEWEST);
    assert!(st.contains(&newest), "the cluster did not move to the newest data format: {st}");
    // A backup through the CLI: 0600, checked whole, never over an existing file.
    let backup = work.join("cluster.gwbk");
    let o = cli(&endpoints, &["cluster", "backup", backup.to_str().unwrap()], &work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout(&o).contains("backup of log index"), "{}", stdout(&o));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&backup).unwrap().permissions().mode() & 0o777, 0o600);
    gangway_raft_store::backup::Backup::from_bytes(&std::fs::read(&backup).unwrap()).unwrap();
    let again = cli(&endpoints, &["cluster", "backup", backup.to_str().unwrap()], &work);
    assert!(!again.status.success(), "a backup replaced an existing file");
    assert!(String::from_utf8_lossy(&again.stderr).contains("never overwritten"));
    assert!(!work.join("cluster.gwbk.partial").exists());

    // SIGKILL an agent while its task runs: the task keeps running under its
    // shim, the restarted agent re-adopts it, and the job completes as attempt 1
    // with the task's real exit code.
    let o = cli(
        &endpoints,
        &["submit", "--parsable", "-N", "2", "--", "sh", "-c", "echo start >> starts-$SLURM_NODEID; sleep 2; exit 7"],
        &work,
    );
    let id = stdout(&o).trim().to_string();
    eventually("the job never started", || work.join("starts-0").exists() && work.join("starts-1").exists());
    // Agents sit at procs 3 (e2e-node-1) and 4 (e2e-node-2); a restarted one
    // goes back in its place.
    let restart_agent = |procs: &mut Procs, n: usize| {
        let agent = &mut procs.0[2 + n];
        agent.kill().unwrap();
        agent.wait().unwrap();
        let args = agent_args(&endpoints, n, dir.path());
        // In a session of its own, as systemd starts services: the tasks it
        // re-adopts stay in the old agent's session.
        let log = std::fs::File::create(dir.path().join(format!("a{n}-restarted.log"))).unwrap();
        let mut agent = Command::new("setsid");
        agent.arg(&agent_exe).args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
        procs.0[2 + n] = agent.spawn().unwrap();
    };
    restart_agent(&mut procs, 1);
    eventually("the re-adopted job never finished", || {
        let o = cli(&endpoints, &["show", &id, "--json"], &work);
        stdout(&o).contains("\"state\": \"FAILED\"")
    });
    let shown = stdout(&cli(&endpoints, &["show", &id, "--json"], &work));
    assert!(shown.contains("\"exit_code\": 7"), "{shown}");
    assert!(shown.contains("\"attempt\": 1"), "the job was requeued instead of re-adopted: {shown}");
    for rank in 0..2 {
        let starts = std::fs::read_to_string(work.join(format!("starts-{rank}"))).unwrap();
        assert_eq!(starts.lines().count(), 1, "rank {rank} started twice");
    }
    // A batch job whose step host's agent is killed and restarted while a
    // step runs there: the step's task outlives it (under its shim, output
    // through the agent's FIFOs), the restarted agent keeps it, srun resumes
    // it, and its output and exit code still come back; the next step runs
    // there too.
    let script = "srun true; other=$(scontrol show hostnames | grep -v $SLURMD_NODENAME); \
                  srun -N1 -n1 -w $other sh -c 'echo $$ > kept.pid; echo before on $SLURMD_NODENAME; \
                  while [ ! -e go ]; do sleep 0.1; done; echo after on $SLURMD_NODENAME; exit 7' & \
                  step=$!; echo $SLURMD_NODENAME > batch-host; wait $step; echo step exited $?; \
                  srun -l sh -c 'echo again on $SLURMD_NODENAME'";
    let o = cli(&endpoints, &["submit", "--parsable", "--batch", "-N", "2", "--", "sh", "-c", script], &work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    eventually("the batch job's step never started", || {
        work.join("batch-host").exists() && work.join("kept.pid").exists()
    });
    let host = std::fs::read_to_string(work.join("batch-host")).unwrap();
    let other = if host.trim() == "e2e-node-1" { 2 } else { 1 };
    let kept: i32 = std::fs::read_to_string(work.join("kept.pid")).unwrap().trim().parse().unwrap();
    restart_agent(&mut procs, other);
    // The restarted agent is back (registered again) and the task still runs.
    eventually("the restarted agent never registered", || {
        std::fs::read_to_string(dir.path().join(format!("a{other}-restarted.log")))
            .is_ok_and(|l| l.contains("kept step tasks from before the restart"))
    });
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
    };
    assert!(alive(kept), "the step's task did not outlive its agent");
    std::fs::write(work.join("go"), "").unwrap();
    eventually("the batch job never completed after its step host's agent restarted", || {
        stdout(&cli(&endpoints, &["show", &id, "--json"], &work)).contains("\"state\": \"COMPLETED\"")
    });
    let out = std::fs::read_to_string(work.join(format!("slurm-{id}.out"))).unwrap();
    for line in [format!("before on e2e-node-{other}"), format!("after on e2e-node-{other}"), "step exited 7".into()] {
        assert!(out.contains(&line), "the resumed step lost {line:?}: {out}");
    }
    assert!(out.contains("step resumed"), "srun did not resume the step: {out}");
    assert!(out.contains(&format!(": again on e2e-node-{other}")), "no step on the restarted node: {out}");
    // An agent that dies and stays dead: its task's shim obeys the agent's
    // lease and stops the task on its own within half the node-down timeout
    // (plus the grace), before the leader declares the node down and could
    // start the job elsewhere.
    let o = cli(
        &endpoints,
        &["submit", "--parsable", "-w", "e2e-node-2", "--", "sh", "-c", "echo $$ > leased.pid; exec sleep 300"],
        &work,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    eventually("the leased task never started", || work.join("leased.pid").exists());
    let leased: i32 = std::fs::read_to_string(work.join("leased.pid")).unwrap().trim().parse().unwrap();
    let agent = &mut procs.0[2 + 2];
    agent.kill().unwrap();
    agent.wait().unwrap();
    let gone = || {
        std::fs::read_to_string(format!("/proc/{leased}/stat"))
            .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
    };
    eventually("a task outlived its dead agent's lease", gone);
    restart_agent(&mut procs, 2);
    policy_and_scheduler_options_through_the_cli(&endpoints, &work);
    sbatch_scripts_through_the_shim(&endpoints, &work, dir.path());
    an_elastic_pool_powers_its_node_up_and_down(&endpoints, &work, dir.path());
    nodes_are_admitted_through_the_cli(&endpoints, &work, dir.path());
}

/// Node admission with the real agents: a class admits what they register;
/// a class that allows fewer GPUs than a node claims takes it down, and its
/// agent's re-registration is refused with the difference named; retiring a
/// node does the same; admitted again, the agents come back by themselves.
fn nodes_are_admitted_through_the_cli(endpoints: &str, work: &Path, dir: &Path) {
    let run = |args: &[&str]| {
        let o = cli(endpoints, args, work);
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let shown = run(&["admin", "inventory", "show"]);
    assert!(shown.contains("no node inventory"), "{shown}");
    let node_line = |name: &str| {
        let text = stdout(&cli(endpoints, &["scontrol", "show", "node", name], work));
        text.split_whitespace().find_map(|w| w.strip_prefix("State=")).unwrap_or("").to_string()
    };
    let class = ["admin", "inventory", "class", "e2e", "--nodes", "e2e-node-[1-2]", "--cpus", "4096", "--mem", "64T"];
    let set = run(&[&class[..], &["--gpus", "h100-80gb:4"]].concat());
    assert!(set.contains("class e2e set (inventory version 1)") && !set.contains("no longer admitted"), "{set}");
    assert_eq!(node_line("e2e-node-1"), "IDLE");
    // Two GPUs a node where the agents claim four: both go down.
    let set = run(&[&class[..], &["--gpus", "h100-80gb:2"]].concat());
    for n in 1..=2 {
        assert!(set.contains(&format!("node e2e-node-{n} is no longer admitted")), "{set}");
    }
    eventually("a node claiming more than its class stayed up", || node_line("e2e-node-1").starts_with("DOWN"));
    let why = stdout(&cli(endpoints, &["scontrol", "show", "node", "e2e-node-1"], work));
    assert!(why.contains("claims 4 GPUs; its class e2e allows at most 2"), "{why}");
    // The agent's next registration is refused, naming the difference.
    let log = |n: usize| {
        let restarted = dir.join(format!("a{n}-restarted.log"));
        std::fs::read_to_string(&restarted).or_else(|_| std::fs::read_to_string(dir.join(format!("a{n}.log"))))
    };
    eventually("the agent's refused registration is not in its log", || {
        log(1).is_ok_and(|l| l.contains("refused to register") && l.contains("claims 4 GPUs"))
    });
    // Admitted again: the agents come back on their own.
    run(&[&class[..], &["--gpus", "h100-80gb:4"]].concat());
    eventually("the admitted nodes never came back", || {
        node_line("e2e-node-1") == "IDLE" && node_line("e2e-node-2") == "IDLE"
    });
    // A retired node (decommissioned, its certificate still valid) stays out.
    let retired = run(&["admin", "inventory", "retire", "e2e-node-2"]);
    assert!(retired.contains("node e2e-node-2 is no longer admitted"), "{retired}");
    eventually("the retired node's agent was not refused", || {
        log(2).is_ok_and(|l| l.contains("refused to register") && l.contains("retired"))
    });
    assert!(node_line("e2e-node-2").starts_with("DOWN"));
    let shown = run(&["admin", "inventory", "show"]);
    assert!(shown.contains("e2e-node-[1-2]") && shown.contains("retired: e2e-node-2"), "{shown}");
    run(&["admin", "inventory", "retire", "e2e-node-2", "--undo"]);
    eventually("the node never came back after its retirement was undone", || node_line("e2e-node-2") == "IDLE");
    // Back to open admission for whatever runs next.
    let o = cli(endpoints, &["admin", "inventory", "class", "e2e", "--remove"], work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The agent of the elastic pool's node, started by the resume program:
/// ended (by the PID its program wrote) when the test ends however it ends.
struct PoolAgent(PathBuf);

impl Drop for PoolAgent {
    fn drop(&mut self) {
        if let Some(pid) = std::fs::read_to_string(&self.0).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    }
}

/// The controllers' power programs for the pool node `e2e-cloud-1`: the
/// resume program starts its agent (as a cloud's API would start an
/// instance) and records the call; the suspend program stops it by PID.
fn pool_programs(agent_exe: &Path, endpoints: &str, dir: &Path) -> (PoolAgent, [PathBuf; 2]) {
    use std::os::unix::fs::PermissionsExt;
    let pid = dir.join("cloud-agent.pid");
    let args = named_agent_args(endpoints, "e2e-cloud-1", &dir.join("agent-cloud")).join(" ");
    let resume = format!(
        "#!/bin/sh\necho \"$1\" >> {d}/resumed\nsetsid {exe} {args} > {d}/cloud-agent.log 2>&1 < /dev/null &\necho $! > {pid}\n",
        d = dir.display(),
        exe = agent_exe.display(),
        pid = pid.display()
    );
    let suspend = format!(
        "#!/bin/sh\necho \"$1\" >> {d}/suspended\nkill $(cat {pid}) && rm -f {pid}\n",
        d = dir.display(),
        pid = pid.display()
    );
    let paths = [dir.join("resume.sh"), dir.join("suspend.sh")];
    for (path, text) in paths.iter().zip([resume, suspend]) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    (PoolAgent(pid), paths)
}

/// An elastic pool: its node is listed powered down before it ever ran; a
/// job that only it can hold powers it up (the resume program starts its
/// agent), runs there once the agent registered, and the idle node is
/// powered down again (the suspend program stops the agent).
fn an_elastic_pool_powers_its_node_up_and_down(endpoints: &str, work: &Path, dir: &Path) {
    let ok = |args: &[&str]| {
        let o = cli(endpoints, args, work);
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    ok(&[
        "admin",
        "pool",
        "add",
        "cloud",
        "--nodes",
        "e2e-cloud-[1]",
        "--cpus",
        "1",
        "--mem",
        "1G",
        "--gpus",
        "h100-80gb:4",
        "--suspend-after",
        "0:03",
        "--resume-timeout",
        "2:00",
    ]);
    let node_state = || {
        let o = cli(endpoints, &["scontrol", "show", "node", "e2e-cloud-1"], work);
        let text = stdout(&o);
        text.split_whitespace().find_map(|w| w.strip_prefix("State=")).unwrap_or("").to_string()
    };
    assert_eq!(node_state(), "IDLE~", "a pool's node is powered down before it ever ran");
    ok(&["admin", "partition", "add", "cloud", "--nodes", "e2e-cloud-1"]);
    let job = ["submit", "--parsable", "-p", "cloud", "--gpus-per-node", "4", "--", "sh", "-c", "hostname > cloud-ran"];
    let id = ok(&job);
    let id = id.trim().to_string();
    let completed = || stdout(&cli(endpoints, &["show", &id, "--json"], work)).contains("\"state\": \"COMPLETED\"");
    let deadline = Instant::now() + WAIT;
    while !completed() {
        if Instant::now() > deadline {
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| format!("({f}: {e})"));
            panic!(
                "the pool's job never completed: {}\nnode: {}\nresumed: {}\nagent log: {}",
                stdout(&cli(endpoints, &["show", &id], work)),
                stdout(&cli(endpoints, &["scontrol", "show", "node", "e2e-cloud-1"], work)),
                read("resumed"),
                read("cloud-agent.log"),
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(work.join("cloud-ran").exists(), "the job did not run");
    let resumed = std::fs::read_to_string(dir.join("resumed")).unwrap();
    assert_eq!(resumed.trim(), "e2e-cloud-1", "the resume program was called once with the node");
    eventually("the idle pool node was never powered down", || node_state() == "IDLE~");
    eventually("the suspend program never ran", || dir.join("suspended").exists());
    assert_eq!(std::fs::read_to_string(dir.join("suspended")).unwrap().trim(), "e2e-cloud-1");
    // It records the call first, then stops the agent.
    eventually("the suspend program did not stop the agent", || !dir.join("cloud-agent.pid").exists());
    ok(&["admin", "partition", "rm", "cloud"]);
    ok(&["admin", "pool", "rm", "cloud"]);
}

/// A job of an ordinary user (whose client certificate says `nobody`) runs as
/// that user with its groups, from a 0700 script of its own, and its output
/// file is the user's; it cannot make itself an admin.
fn ordinary_users_jobs_run_as_them(endpoints: &str, dir: &Path) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let shared = dir.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let nobody = |args: &[&str]| {
        as_user(Command::new(GANGWAY).args(args), "nobody")
            .env("GANGWAY_ENDPOINTS", endpoints)
            .current_dir(&shared)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let o = nobody(&["submit", "--parsable", "--wrap", "id -un; id -G; ls -l $0 | cut -c1-10"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    eventually("nobody's job never completed", || {
        stdout(&cli(endpoints, &["show", &id, "--json"], &shared)).contains("\"state\": \"COMPLETED\"")
    });
    let out_path = shared.join(format!("slurm-{id}.out"));
    let out = std::fs::read_to_string(&out_path).unwrap();
    assert_eq!(out.lines().collect::<Vec<_>>(), ["nobody", "65534", "-rwx------"], "{out}");
    let meta = std::fs::metadata(&out_path).unwrap();
    assert_eq!(meta.uid(), 65534, "the output file is the user's");
    // The submitter's umask (this test's 022), not the agent's 077.
    assert_eq!(meta.mode() & 0o777, 0o644);
    // The agent's state is reachable by name only (the job's user reads its
    // own script and writes its exit file there), its files private; nobody's
    // script is gone with its task.
    for n in 1..=2 {
        let state = dir.join(format!("agent-{n}"));
        assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o777, 0o711, "{}", state.display());
        let fences = std::fs::read_dir(&state).unwrap().flatten().filter(|e| e.path().is_file());
        for f in fences {
            assert_eq!(f.metadata().unwrap().mode() & 0o077, 0, "{} is readable by others", f.path().display());
        }
        // Kept step tasks' files: their shims, as the job's user, write
        // their exit files there.
        assert_eq!(std::fs::metadata(state.join("steps")).unwrap().mode() & 0o777, 0o711);
        let scripts = state.join("scripts");
        if let Ok(m) = std::fs::metadata(&scripts) {
            assert_eq!(m.mode() & 0o777, 0o711, "{}", scripts.display());
            let left: Vec<_> = std::fs::read_dir(&scripts).unwrap().flatten().map(|e| e.file_name()).collect();
            assert!(!left.iter().any(|f| f.to_string_lossy().starts_with(&format!("job-{id}-"))), "{left:?}");
        }
    }
    // Its srun steps run as it on both nodes too (on the other node started
    // by that agent's shim), with its groups and the submitter's umask.
    std::fs::write(
        shared.join("steps.sh"),
        "#!/bin/sh\n#SBATCH -N 2\nsrun -l sh -c 'echo \"$(id -un) $(id -G) $(umask)\"'\n",
    )
    .unwrap();
    let o = nobody(&["sbatch", "--parsable", "steps.sh"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    eventually("nobody's steps never completed", || {
        stdout(&cli(endpoints, &["show", &id, "--json"], &shared)).contains("\"state\": \"COMPLETED\"")
    });
    let out = std::fs::read_to_string(shared.join(format!("slurm-{id}.out"))).unwrap();
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["0: nobody 65534 0022", "1: nobody 65534 0022"], "{out}");
    // Inside its job, the Slurm commands act as it with the job's credential
    // (it has no certificate of its own there).
    let o = nobody(&["submit", "--parsable", "--wrap", "squeue -h -j $SLURM_JOB_ID -o '%i %u %T'"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    eventually("nobody's squeue job never completed", || {
        stdout(&cli(endpoints, &["show", &id, "--json"], &shared)).contains("\"state\": \"COMPLETED\"")
    });
    let out = std::fs::read_to_string(shared.join(format!("slurm-{id}.out"))).unwrap();
    assert_eq!(out.trim(), format!("{id} nobody RUNNING"));
    // An ordinary user cannot make itself an admin.
    let o = nobody(&["admin", "set", "--admins", "nobody"]);
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && said.contains("permission denied"), "{said}");
    // The attempt is in the audit trail, which nobody may not read and root may.
    let o = nobody(&["events", "--audit"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("permission denied"));
    let mut trail = as_user(Command::new(GANGWAY).args(["events", "--audit", "--json"]), "root")
        .env("GANGWAY_ENDPOINTS", endpoints)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let _ = trail.kill();
    let o = trail.wait_with_output().unwrap();
    let lines = stdout(&o);
    assert!(
        lines.lines().any(|l| l.contains("\"caller\":\"client:nobody\"") && l.contains("\"outcome\":\"denied\"")),
        "{lines}"
    );
}

/// A batch script with #SBATCH directives, submitted through the `sbatch`
/// link that `gangway shims install` makes, as a Slurm user would.
fn sbatch_scripts_through_the_shim(endpoints: &str, work: &Path, dir: &Path) {
    let bin = dir.join("bin");
    let o = cli(endpoints, &["shims", "install", "--prefix", bin.to_str().unwrap()], work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let sbatch = bin.join("sbatch");
    let run = |args: &[&str]| {
        Command::new(&sbatch)
            .args(args)
            .env("GANGWAY_ENDPOINTS", endpoints)
            .env("GANGWAY_TLS_DIR", pki())
            .env("FOO", "from-submit-env")
            .current_dir(work)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    std::fs::write(
        work.join("train.sh"),
        "#!/bin/bash\n\
         # a training job\n\
         #SBATCH --job-name=e2e-sbatch --nodes=1   # one node\n\
         #SBATCH --gpus-per-node=1\n\
         #SBATCH --time=5 --mail-type=END\n\
         echo \"name=$SLURM_JOB_NAME args=$* gpus=$CUDA_VISIBLE_DEVICES foo=$FOO\"\n\
         #SBATCH --nodes=99\n",
    )
    .unwrap();
    let o = run(&["train.sh", "first", "second"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    let id: u64 = out.trim().strip_prefix("Submitted batch job ").unwrap_or_else(|| panic!("{out}")).parse().unwrap();
    let notes = String::from_utf8_lossy(&o.stderr);
    assert!(notes.contains("line 5: --mail-type has no effect"), "{notes}");
    eventually("the sbatch job's output never appeared", || {
        std::fs::read_to_string(work.join(format!("slurm-{id}.out")))
            .is_ok_and(|s| s.trim() == "name=e2e-sbatch args=first second gpus=0 foo=from-submit-env")
    });
    let done = id;
    // With --constrain-devices, a task may open only its own GPUs, whatever
    // CUDA_VISIBLE_DEVICES says (which counts from 0: CUDA's numbering of
    // what it can open); the devices cgroup is joined by the shim before the
    // script runs. Fake GPUs: device nodes of the NVIDIA major; with no
    // driver here, opening one the cgroup allows fails with ENXIO, one it
    // refuses with EPERM first.
    let dev = work.join("fake-dev");
    std::fs::create_dir_all(&dev).unwrap();
    for g in 0..4 {
        let node = dev.join(format!("nvidia{g}"));
        let _ = std::fs::remove_file(&node);
        let made = Command::new("mknod").args(["-m", "666"]).arg(&node).args(["c", "195", &g.to_string()]).status();
        assert!(made.unwrap().success(), "mknod {}", node.display());
    }
    let probe = format!(
        "echo mine=$SLURM_JOB_GPUS visible=$CUDA_VISIBLE_DEVICES; unset CUDA_VISIBLE_DEVICES; for g in 0 1 2 3; do \
         echo gpu$g: $(dd if={}/nvidia$g of=/dev/null count=1 2>&1 | head -1); done",
        dev.display()
    );
    assert!(run(&["--gpus-per-node=1", "-o", "gpus.log", "--wrap", &probe]).status.success());
    let mut seen = String::new();
    eventually("the GPU probe never ran", || {
        seen = std::fs::read_to_string(work.join("gpus.log")).unwrap_or_default();
        seen.lines().count() == 5
    });
    let first = seen.lines().next().unwrap_or_default();
    let mine =
        first.strip_prefix("mine=").and_then(|l| l.strip_suffix(" visible=0")).unwrap_or_else(|| panic!("{seen}"));
    for line in seen.lines().skip(1) {
        let (gpu, said) = line.split_once(": ").unwrap_or_else(|| panic!("{seen}"));
        if gpu == format!("gpu{mine}") {
            assert!(said.contains("No such device"), "its own GPU reached the driver: {seen}");
        } else {
            assert!(said.contains("Operation not permitted"), "another task's GPU was refused: {seen}");
        }
    }
    // The command line overrides a directive; --parsable prints the id alone.
    let o = run(&["--parsable", "--job-name", "renamed", "train.sh"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().to_string();
    assert!(id.parse::<u64>().is_ok(), "{id}");
    let shown = stdout(&cli(endpoints, &["show", &id, "--json"], work));
    assert!(shown.contains("\"name\": \"renamed\""), "{shown}");
    // --open-mode: as in Slurm, sbatch's output file is truncated when the
    // job starts, unless appended to (Slurm reads the first letter).
    for f in ["kept.log", "fresh.log"] {
        std::fs::write(work.join(f), "old\n").unwrap();
    }
    assert!(run(&["-o", "kept.log", "--open-mode=A", "--wrap", "echo new"]).status.success());
    assert!(run(&["-o", "fresh.log", "--wrap", "echo new"]).status.success());
    eventually("--open-mode was not honoured", || {
        let read = |f: &str| std::fs::read_to_string(work.join(f)).unwrap_or_default();
        read("kept.log") == "old\nnew\n" && read("fresh.log") == "new\n"
    });
    // --wait: sbatch returns when the job has ended, with its exit code.
    let o = run(&["--wait", "--wrap", "sleep 0.5; exit 3"]);
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout(&o).starts_with("Submitted batch job "), "{}", stdout(&o));
    assert_eq!(run(&["-W", "--parsable", "--array=0-2", "--wrap", "true"]).status.code(), Some(0));
    // --nodelist picks the node; excluding every node leaves a job that could
    // never run, and scontrol says which nodes turned it down and why.
    assert!(run(&["-w", "e2e-node-2", "-o", "where.log", "--wrap", "echo $SLURMD_NODENAME"]).status.success());
    eventually("the --nodelist job never ran", || {
        std::fs::read_to_string(work.join("where.log")).is_ok_and(|s| s.trim() == "e2e-node-2")
    });
    let o = run(&["--parsable", "-x", "e2e-node-[1-2]", "--wrap", "true"]);
    let nowhere = stdout(&o).trim().to_string();
    eventually("the job excluding every node was not explained", || {
        let shown = stdout(&cli(endpoints, &["scontrol", "show", "job", &nowhere], work));
        shown.contains("Reason=BadConstraints")
            && shown.contains("ExcNodeList=e2e-node-[1-2]")
            && shown.contains("excluded by the job")
    });
    assert!(cli(endpoints, &["cancel", &nowhere], work).status.success());
    // An unknown directive: the line and a suggestion, exit 1, nothing submitted.
    std::fs::write(work.join("typo.sh"), "#!/bin/sh\n#SBATCH --partitoin=gpu\ntrue\n").unwrap();
    let o = run(&["typo.sh"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("line 2: unknown option --partitoin; did you mean --partition?"), "{err}");
    let q = stdout(&cli(endpoints, &["queue", "--all", "--json"], work));
    assert!(!q.contains("typo.sh"), "{q}");
    slurm_commands_through_the_shims(endpoints, work, &bin, done);
}

/// squeue, scancel, sacct, scontrol and sinfo answer as Slurm's do, through links.
fn slurm_commands_through_the_shims(endpoints: &str, work: &Path, bin: &Path, done: u64) {
    // A Slurm command through its link, as `identity`.
    let shim = |name: &str, identity: &str| {
        let mut c = Command::new(bin.join(name));
        as_user(&mut c, identity.rsplit(':').next().unwrap());
        c.env("GANGWAY_ENDPOINTS", endpoints).current_dir(work).stdin(Stdio::null());
        c
    };
    let tool = |name: &str, args: &[&str]| {
        let o = shim(name, "dev:root").args(args).output().unwrap();
        assert!(o.status.success(), "{name} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    // The finished sbatch job, in sacct's parsable form, with its batch step.
    let lines = tool("sacct", &["-j", &done.to_string(), "-n", "-P", "-o", "JobID,JobName,State,ExitCode,NNodes"]);
    let want = format!("{done}|e2e-sbatch|COMPLETED|0:0|1\n{done}.batch|batch|COMPLETED|0:0|1");
    assert_eq!(lines.trim(), want);
    let line = tool("sacct", &["-X", "-j", &done.to_string(), "-n", "-P", "-o", "JobID,State"]);
    assert_eq!(line.trim(), format!("{done}|COMPLETED"));
    assert_eq!(tool("scontrol", &["show", "hostnames", "e2e-node-[1-2]"]), "e2e-node-1\ne2e-node-2\n");
    let node = tool("scontrol", &["-o", "show", "node", "e2e-node-1"]);
    assert!(node.starts_with("NodeName=e2e-node-1 ") && node.contains("Gres=gpu:"), "{node}");
    let nodes = tool("sinfo", &["-N", "-h", "-o", "%N"]);
    assert!(nodes.lines().any(|l| l.trim() == "e2e-node-2"), "{nodes}");
    // A throttled array: squeue shows its elements as 12_3; scancel of the
    // array's id ends all of them; sacct reports them cancelled.
    let base = tool("sbatch", &["--parsable", "--array=0-3%1", "--wrap", "sleep 60"]).trim().to_string();
    eventually("an array element never started", || {
        tool("squeue", &["-h", "-j", &base, "-o", "%i %t"]).lines().any(|l| l.ends_with(" R"))
    });
    let q = tool("squeue", &["-h", "-j", &base, "-o", "%i %t %r"]);
    assert_eq!(q.lines().count(), 4, "{q}");
    assert!(q.contains(&format!("{base}_3 PD JobArrayTaskLimit")), "{q}");
    tool("scancel", &[&base]);
    let states = tool("sacct", &["-X", "-j", &base, "-n", "-P", "-o", "JobID,State"]);
    let want: Vec<String> = (0..4).map(|i| format!("{base}_{i}|CANCELLED")).collect();
    assert_eq!(states.lines().collect::<Vec<_>>(), want, "{states}");
    assert_eq!(tool("squeue", &["-h", "-j", &base, "-t", "PD,R"]), "");
    // A 2-node batch job, 2 tasks per node: the script runs once, on the
    // first node; srun starts each step's tasks on both nodes (the second
    // node's through its agent) and gathers their output and exit codes into
    // the one output file, as Slurm does.
    std::fs::write(
        work.join("steps.sh"),
        "#!/bin/bash\n\
         #SBATCH -N 2 --ntasks-per-node=2 --gpus-per-node=2 -J steps\n\
         echo \"batch on $SLURMD_NODENAME of $SLURM_JOB_NODELIST\"\n\
         export FROM_SCRIPT=set-in-script\n\
         srun --label --gpus-per-task=1 bash -c 'echo task $SLURM_PROCID local $SLURM_LOCALID node $SLURM_NODEID of $SLURM_NTASKS on $SLURMD_NODENAME gpus $CUDA_VISIBLE_DEVICES env $FROM_SCRIPT'\n\
         srun -N1 -n1 -w e2e-node-2 bash -c 'echo helper on $SLURMD_NODENAME; echo helper-err >&2'\n\
         srun -n 3 false || echo \"step failed with $?\"\n\
         srun -N1 -n1 -w e2e-node-2 bash -c 'exit 4'; echo \"remote exit $?\"\n\
         srun -K -N2 bash -c 'if [ $SLURM_NODEID = 1 ]; then exit 5; fi; sleep 600'; echo \"killed step exit $?\"\n",
    )
    .unwrap();
    // srun is found without installing the links: agents put their own on
    // every task's PATH.
    let o = shim("sbatch", "dev:root").args(["--parsable", "steps.sh"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let steps = stdout(&o).trim().to_string();
    eventually("the srun job never finished", || {
        tool("sacct", &["-X", "-j", &steps, "-n", "-P", "-o", "State"]).trim() == "COMPLETED"
    });
    let out = std::fs::read_to_string(work.join(format!("slurm-{steps}.out"))).unwrap();
    assert!(!work.join(format!("slurm-{steps}.1.out")).exists(), "the second node wrote an output file: {out}");
    let batch: Vec<&str> = out.lines().filter(|l| l.starts_with("batch on ")).collect();
    assert_eq!(batch.len(), 1, "the script must run once: {out}");
    let host = batch[0].split(' ').nth(2).unwrap();
    let shown = tool("scontrol", &["show", "job", &steps]);
    assert!(shown.contains(&format!("BatchHost={host}")), "{shown}");
    let task = |rank: u32| out.lines().find(|l| l.starts_with(&format!("{rank}: task {rank} "))).unwrap_or_default();
    let mut gpus = Vec::new();
    for rank in 0..4 {
        let line = task(rank);
        let (local, node) = (rank % 2, rank / 2);
        assert!(line.contains(&format!("local {local} node {node} of 4 on ")), "task {rank}: {out}");
        assert!(line.ends_with("env set-in-script"), "the script's environment must reach every task: {out}");
        // The first node runs ranks 0-1 (where the script runs), the other 2-3.
        assert_eq!(line.contains(&format!(" on {host} ")), node == 0, "task {rank} on the wrong node: {out}");
        let g = line.split(" gpus ").nth(1).unwrap().split(' ').next().unwrap().to_string();
        gpus.push((node, g));
    }
    assert_ne!(gpus[0], gpus[1], "two tasks got the same GPU: {out}");
    assert_ne!(gpus[2], gpus[3], "two remote tasks got the same GPU: {out}");
    assert_eq!(out.matches("helper on e2e-node-2").count(), 1, "{out}");
    assert!(out.contains("helper-err"), "a remote task's stderr must come back: {out}");
    assert_eq!(out.matches("step failed with 1").count(), 1, "{out}");
    assert!(out.contains("remote exit 4"), "a remote task's exit code must come back: {out}");
    assert!(out.contains("killed step exit 5"), "--kill-on-bad-exit must end the step: {out}");

    // A heterogeneous job (#SBATCH hetjob): a 2-GPU component and a CPU
    // component, each on a node of its own, started together; the script
    // runs in component 0, srun --het-group picks a component's nodes, and
    // squeue/sacct show ID+0 and ID+1.
    std::fs::write(
        work.join("het.sh"),
        "#!/bin/bash\n\
         #SBATCH -N1 --gpus-per-node=2 -J het\n\
         #SBATCH hetjob\n\
         #SBATCH -N1 -c 2\n\
         echo \"size $SLURM_HET_SIZE g0 $SLURM_JOB_NODELIST_HET_GROUP_0 g1 $SLURM_JOB_NODELIST_HET_GROUP_1 all $SLURM_JOB_NODELIST\"\n\
         srun bash -c 'echo default on $SLURMD_NODENAME'\n\
         srun --het-group=1 bash -c 'echo group1 on $SLURMD_NODENAME cpus $SLURM_CPUS_PER_TASK_HET_GROUP_1'\n\
         srun --het-group=0,1 bash -c 'echo both on $SLURMD_NODENAME' | sort\n\
         srun --het-group=2 true || echo \"no group 2\"\n\
         sleep 8\n",
    )
    .unwrap();
    let o = shim("sbatch", "dev:root").args(["--parsable", "het.sh"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let het = stdout(&o).trim().to_string();
    eventually("the heterogeneous job never started", || {
        tool("squeue", &["-h", "-j", &het, "-o", "%i %t"]).lines().filter(|l| l.ends_with(" R")).count() == 2
    });
    let q = tool("squeue", &["-h", "-j", &het, "-o", "%i %D %N"]);
    assert!(q.contains(&format!("{het}+0 1 ")) && q.contains(&format!("{het}+1 1 ")), "{q}");
    // A step into the running het job from outside it: component 1 on request.
    let node1 = q.lines().find_map(|l| l.strip_prefix(&format!("{het}+1 1 "))).unwrap().trim().to_string();
    let said = tool("srun", &[&format!("--jobid={het}"), "--het-group=1", "sh", "-c", "echo on $SLURMD_NODENAME"]);
    assert_eq!(said.trim(), format!("on {node1}"), "{said}");
    eventually("the heterogeneous job never finished", || {
        tool("sacct", &["-X", "-j", &het, "-n", "-P", "-o", "State"]).trim() == "COMPLETED\nCOMPLETED"
    });
    let out = std::fs::read_to_string(work.join(format!("slurm-{het}.out"))).unwrap();
    let head = out.lines().next().unwrap_or_default().to_string();
    let words: Vec<&str> = head.split(' ').collect();
    assert_eq!((words[0], words[1]), ("size", "2"), "{out}");
    let (g0, g1) = (words[3], words[5]);
    assert_ne!(g0, g1, "the components share a node: {out}");
    assert!(out.contains(&format!("default on {g0}")), "srun runs in component 0 by default: {out}");
    assert!(out.contains(&format!("group1 on {g1} cpus 2")), "{out}");
    assert_eq!(out.matches("both on ").count(), 2, "{out}");
    assert!(out.contains("no group 2"), "{out}");
    let acct = tool("sacct", &["-j", &het, "-n", "-P", "-o", "JobID,NodeList"]);
    assert!(acct.contains(&format!("{het}+0|{g0}")) && acct.contains(&format!("{het}+1|{g1}")), "{acct}");
    assert!(acct.contains(&format!("{het}+0.batch|{g0}")), "{acct}");
    let shown = tool("scontrol", &["show", "job", &het]);
    for k in 0..2 {
        assert!(shown.contains(&format!("JobId={het}+{k} ")), "{shown}");
        assert!(shown.contains(&format!("HetJobId={het} HetJobOffset={k}")), "{shown}");
    }
    assert_eq!(shown.matches(&format!("BatchHost={g0}")).count(), 1, "{shown}");
    // salloc's heterogeneous allocation (OPTIONS : OPTIONS), held; a step
    // runs in its component 1, then it is given back.
    let o = shim("salloc", "dev:root").args(["--no-shell", "-N1", ":", "-N1", "-c", "2"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    let held =
        err.split("Granted job allocation ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().to_string();
    let q = tool("squeue", &["-h", "-j", &held, "-o", "%i %C %N"]);
    let node1 = q.lines().find_map(|l| l.strip_prefix(&format!("{held}+1 2 "))).unwrap_or_else(|| panic!("{q}"));
    let said = tool("srun", &[&format!("--jobid={held}"), "--het-group=1", "sh", "-c", "echo on $SLURMD_NODENAME"]);
    assert_eq!(said.trim(), format!("on {}", node1.trim()), "{said}");
    tool("scancel", &[&held]);

    // Slurm's --signal in batch jobs (2 s into a 1-minute limit): without B:
    // every task of the job gets it, on both nodes, but not the batch shell;
    // with B: only the batch shell does.
    std::fs::write(
        work.join("warned.sh"),
        "#!/bin/bash\n\
         #SBATCH -N 2 -t 1 --signal=USR1@58\n\
         srun bash -c 'trap \"echo warned on $SLURMD_NODENAME; exit 0\" USR1; for i in $(seq 300); do sleep 0.1; done'\n\
         echo shell survived\n",
    )
    .unwrap();
    std::fs::write(
        work.join("shell-warned.sh"),
        "#!/bin/bash\n\
         #SBATCH -N 1 -t 1 --signal=B:USR1@58\n\
         trap 'echo shell warned' USR1\n\
         bash -c 'trap \"echo child warned\" USR1; for i in $(seq 40); do sleep 0.1; done' &\n\
         wait; wait\n\
         echo shell done\n",
    )
    .unwrap();
    // SIGTERM as the warning: neither srun nor the other node's step host
    // may take it for a stop.
    std::fs::write(
        work.join("term-warned.sh"),
        "#!/bin/bash\n\
         #SBATCH -N 2 -t 1 --signal=TERM@58\n\
         srun bash -c 'trap \"echo term on $SLURMD_NODENAME; exit 0\" TERM; for i in $(seq 300); do sleep 0.1; done'\n\
         echo shell survived\n",
    )
    .unwrap();
    let ids: Vec<String> = ["warned.sh", "shell-warned.sh", "term-warned.sh"]
        .iter()
        .map(|f| stdout(&shim("sbatch", "dev:root").args(["--parsable", f]).output().unwrap()).trim().to_string())
        .collect();
    eventually("the --signal jobs never finished", || {
        ids.iter().all(|id| tool("sacct", &["-X", "-j", id, "-n", "-P", "-o", "State"]).trim() == "COMPLETED")
    });
    let warned = std::fs::read_to_string(work.join(format!("slurm-{}.out", ids[0]))).unwrap();
    for n in 1..=2 {
        assert!(warned.contains(&format!("warned on e2e-node-{n}")), "a task missed the warning: {warned}");
    }
    assert!(warned.contains("shell survived"), "the batch shell got the warning: {warned}");
    let shell = std::fs::read_to_string(work.join(format!("slurm-{}.out", ids[1]))).unwrap();
    assert!(shell.contains("shell warned") && shell.contains("shell done"), "{shell}");
    assert!(!shell.contains("child warned"), "B: must signal only the batch shell: {shell}");
    let term = std::fs::read_to_string(work.join(format!("slurm-{}.out", ids[2]))).unwrap();
    for n in 1..=2 {
        assert!(term.contains(&format!("term on e2e-node-{n}")), "a task missed the TERM warning: {term}");
    }
    assert!(term.contains("shell survived"), "{term}");

    // salloc: an allocation held while a command runs here; srun in it starts
    // the step on the allocated nodes, output streamed back through the agents.
    let o = shim("salloc", "dev:root")
        .args(["-N", "2", GANGWAY, "srun", "-l", "bash", "-c", "echo on $SLURMD_NODENAME"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = stdout(&o);
    assert!(said.contains("0: on e2e-node-") && said.contains("1: on e2e-node-"), "{said}");
    assert!(said.contains("on e2e-node-1") && said.contains("on e2e-node-2"), "{said}");
    let granted = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(granted.contains("Granted job allocation") && granted.contains("Relinquishing"), "{granted}");
    let o = shim("salloc", "dev:root").args(["-N", "1", "sh", "-c", "exit 4"]).output().unwrap();
    assert_eq!(o.status.code(), Some(4), "{}", String::from_utf8_lossy(&o.stderr));
    // The allocation ends with the command's exit code, as Slurm's does: 0
    // COMPLETED, 4 FAILED with 4; not CANCELLED.
    let granted = |o: &Output| -> String {
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        let at = err.find("Granted job allocation ").expect("granted") + "Granted job allocation ".len();
        err[at..].split_whitespace().next().unwrap().to_string()
    };
    let failed = granted(&o);
    let ok = shim("salloc", "dev:root").args(["-N", "2", "true"]).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let completed = granted(&ok);
    for (id, want) in [(&completed, "COMPLETED|0:0"), (&failed, "FAILED|4:0")] {
        let got = tool("sacct", &["-X", "-j", id, "-n", "-P", "-o", "State,ExitCode"]);
        assert_eq!(got.trim(), want, "salloc job {id}");
    }

    // srun from outside a job: a job of its own, output streamed, exit code kept.
    let said = tool("srun", &["-N", "2", "-l", "bash", "-c", "echo on $SLURMD_NODENAME"]);
    assert!(said.contains("0: on e2e-node-1") && said.contains("1: on e2e-node-2"), "{said}");
    let o = shim("srun", "dev:root").args(["bash", "-c", "echo failing; exit 3"]).output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout(&o).contains("failing"), "{}", stdout(&o));

    // --test-only: where and when, and nothing submitted.
    let before = tool("sacct", &["-X", "-a", "-n", "-P", "-o", "JobID"]).lines().count();
    let o = shim("sbatch", "dev:root").args(["--test-only", "-N", "2", "--wrap", "true"]).output().unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && said.contains(" to start at ") && said.contains("on nodes e2e-node-[1-2]"), "{said}");
    let o = shim("sbatch", "dev:root").args(["--test-only", "-N", "5", "--wrap", "true"]).output().unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && said.contains("could never run"), "{said}");
    assert_eq!(
        tool("sacct", &["-X", "-a", "-n", "-P", "-o", "JobID"]).lines().count(),
        before,
        "test-only submitted a job"
    );

    // --priority: an admin's job gets it (submitted held here, so it stays put);
    // anyone else is refused before anything is submitted.
    let pinned = tool("sbatch", &["--parsable", "--priority", "4242", "-H", "--wrap", "true"]).trim().to_string();
    let shown = stdout(&cli(endpoints, &["show", &pinned, "--json"], work));
    assert!(shown.contains("4242") && shown.contains("JobHeldUser"), "{shown}");
    tool("scancel", &[&pinned]);
    let o = cli(endpoints, &["admin", "set", "--admins", "root"], work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = tool("sacct", &["-X", "-a", "-n", "-P", "-o", "JobID"]).lines().count();
    let o = shim("sbatch", "dev:mallory").args(["--priority", "9", "--wrap", "true"]).output().unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && said.contains("--priority: only operators and admins"), "{said}");
    assert_eq!(tool("sacct", &["-X", "-a", "-n", "-P", "-o", "JobID"]).lines().count(), before);

    // --begin keeps a job pending (BeginTime) until then; --comment is kept.
    let later = tool("sbatch", &["--parsable", "--begin", "now+1hour", "--comment", "after lunch", "--wrap", "true"]);
    let later = later.trim().to_string();
    eventually("the deferred job never showed BeginTime", || {
        tool("squeue", &["-h", "-j", &later, "-o", "%t|%r|%k"]).trim() == "PD|BeginTime|after lunch"
    });
    let shown: serde_json::Value =
        serde_json::from_str(&stdout(&cli(endpoints, &["show", &later, "--json"], work))).unwrap();
    assert_eq!(shown["pending"]["reason"].as_str(), Some("BeginTime"), "{shown}");
    assert!(shown["pending"]["estimated_start"].as_str().is_some_and(|t| t.starts_with("20")), "{shown}");
    tool("scancel", &[&later]);

    // The event stream from the start of the log: the sbatch job's end, as JSON.
    let o = cli(
        endpoints,
        &["events", "--from", "1", "--job", &done.to_string(), "--kinds", "finished", "--count", "1", "--json"],
        work,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ev: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        (ev["kind"].as_str(), ev["state"].as_str(), ev["job_id"].as_u64()),
        (Some("finished"), Some("COMPLETED"), Some(done))
    );
    // Just ended, named: shown (as Slurm does until MinJobAge), cancelled.
    assert_eq!(tool("squeue", &["-h", "-j", &format!("{base}_2"), "-o", "%i %t"]).trim(), format!("{base}_2 CA"));
    reservations_and_licenses_through_the_shims(endpoints, work, &shim);
    suspend_and_resume_through_the_shims(endpoints, work, &shim);
    interactive_steps_under_tmux(endpoints, work, bin, &shim);
}

/// A tmux server of the test's own (its socket under the work directory),
/// killed when the test ends however it ends.
struct Tmux(PathBuf);

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let o = Command::new("tmux").arg("-S").arg(&self.0).args(args).stdin(Stdio::null()).output();
        let o = o.expect("tmux is not installed (deploy/setup-debian.sh installs it)");
        assert!(o.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    }

    /// Starts `command` (a shell line) in a new 100x30 session `name`.
    fn start(&self, name: &str, command: &str) {
        self.run(&["new-session", "-d", "-s", name, "-x", "100", "-y", "30", command]);
    }

    fn keys(&self, name: &str, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", name];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    fn screen(&self, name: &str) -> String {
        self.run(&["capture-pane", "-p", "-J", "-S", "-200", "-t", name])
    }

    /// Waits until the session's screen shows `text`; the screen so far.
    fn shows(&self, name: &str, text: &str) -> String {
        let mut last = String::new();
        let deadline = Instant::now() + WAIT;
        while !last.contains(text) {
            assert!(Instant::now() < deadline, "the terminal never showed {text:?}:\n{last}");
            std::thread::sleep(Duration::from_millis(100));
            last = self.screen(name);
        }
        last
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").arg("-S").arg(&self.0).arg("kill-server").output();
    }
}

/// Interactive work through a real terminal (tmux, typed into with
/// send-keys and read with capture-pane): `srun --pty` from the login node
/// (its own job), salloc's shell on the first node, and `srun --jobid --pty`
/// into a running batch job, each a real pseudo-terminal relayed through the
/// agent's step service (secured: the job's step credential), with window
/// size and Ctrl-C reaching the remote side; another user cannot attach.
fn interactive_steps_under_tmux(endpoints: &str, work: &Path, bin: &Path, shim: &dyn Fn(&str, &str) -> Command) {
    let tool = |name: &str, args: &[&str]| {
        let o = shim(name, "dev:root").args(args).output().unwrap();
        assert!(o.status.success(), "{name} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let tmux = Tmux(work.join("tmux.sock"));
    // What a user's terminal runs: the command with their cluster settings,
    // then its exit code, and the pane stays to be read.
    let d = pki();
    let session = |cmd: &str| {
        format!(
            "cd {work} && env GANGWAY_ENDPOINTS={endpoints} GANGWAY_TLS_CA={ca} GANGWAY_TLS_CERT={cert} \
             GANGWAY_TLS_KEY={key} PS1='gw$ ' {cmd}; echo \"exited $?\"; sleep 600",
            work = work.display(),
            ca = d.join("ca.pem").display(),
            cert = d.join("client-root.pem").display(),
            key = d.join("client-root-key.pem").display(),
        )
    };
    // srun --pty from the login node: a job of its own, a shell on a terminal.
    tmux.start("pty", &session(&format!("{} --pty bash --norc --noprofile", bin.join("srun").display())));
    let screen = tmux.shows("pty", "gw$ ");
    let job = screen
        .split("srun: job ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("srun printed its job id")
        .to_string();
    tmux.keys("pty", &["echo $((6*7)) on $SLURMD_NODENAME; tty; stty size", "Enter"]);
    let screen = tmux.shows("pty", "42 on e2e-node-");
    let size = tmux.run(&["display", "-p", "-t", "pty", "#{pane_height} #{pane_width}"]);
    assert!(screen.contains("/dev/pts/"), "the task has no terminal: {screen}");
    assert!(screen.contains(size.trim()), "the terminal is not the pane's size ({size}): {screen}");
    // A window size change follows.
    tmux.run(&["resize-window", "-t", "pty", "-x", "120", "-y", "40"]);
    let size = tmux.run(&["display", "-p", "-t", "pty", "#{pane_height} #{pane_width}"]);
    assert_ne!(size.trim(), "30 100", "tmux did not resize");
    tmux.keys("pty", &["clear; echo size is $(stty size)", "Enter"]);
    tmux.shows("pty", &format!("size is {}", size.trim()));
    // Ctrl-C is a key: the remote terminal makes it SIGINT for the
    // foreground command, and the shell goes on.
    tmux.keys("pty", &["sleep 300", "Enter"]);
    std::thread::sleep(Duration::from_millis(500));
    tmux.keys("pty", &["C-c"]);
    tmux.keys("pty", &["echo after-$((1+1))-interrupt", "Enter"]);
    tmux.shows("pty", "after-2-interrupt");
    // A background job the shell leaves behind ends with the session.
    // (Quoted apart, so that the typed line does not read as the answer.)
    tmux.keys("pty", &["sleep 300 & echo b\"\"g=$!", "Enter"]);
    let screen = tmux.shows("pty", "bg=");
    let bg: i32 = screen.split("bg=").last().and_then(|r| r.split_whitespace().next()).unwrap().parse().unwrap();
    tmux.keys("pty", &["exit 3", "Enter"]);
    tmux.shows("pty", "exited 3");
    eventually("a background job outlived its terminal step", || {
        std::fs::read_to_string(format!("/proc/{bg}/stat"))
            .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
    });
    // Input that is not a terminal: relayed, its end (even mid-line) the
    // terminal's end of file.
    let mut piped =
        shim("srun", "dev:root").args(["--pty", "cat"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    {
        use std::io::Write;
        piped.stdin.take().unwrap().write_all(b"no newline at the end").unwrap();
    }
    let o = piped.wait_with_output().unwrap();
    assert!(o.status.success() && stdout(&o).contains("no newline at the end"), "{}", stdout(&o));
    let steps = tool("sacct", &["-j", &job, "-n", "-P", "-o", "JobID,JobName,State,ExitCode"]);
    assert!(steps.contains(&format!("{job}.0|bash|FAILED|3:0")), "{steps}");
    assert!(steps.lines().count() == 3, "only the batch line and the shell's step: {steps}");

    // salloc without a command: the user's shell on the first node.
    tmux.start("salloc", &session(&format!("SHELL=/bin/sh {} -N 2", bin.join("salloc").display())));
    tmux.shows("salloc", "gw$ ");
    tmux.keys("salloc", &["echo shell on $SLURMD_NODENAME; srun -l hostname | sort", "Enter"]);
    let screen = tmux.shows("salloc", "1: ");
    assert!(screen.contains("shell on e2e-node-1") && screen.contains("0: "), "{screen}");
    tmux.keys("salloc", &["exit", "Enter"]);
    let screen = tmux.shows("salloc", "exited 0");
    assert!(screen.contains("Relinquishing job allocation"), "{screen}");

    // srun --jobid --pty: a shell inside a running batch job, on the node
    // asked for; another user's attempt is refused.
    let running = tool("sbatch", &["--parsable", "-N", "2", "--wrap", "sleep 300"]);
    let running = running.trim().to_string();
    eventually("the job to attach to never ran", || tool("squeue", &["-h", "-j", &running, "-o", "%t"]).trim() == "R");
    let attach = format!("{} --jobid={running} -w e2e-node-2 --pty /bin/sh", bin.join("srun").display());
    tmux.start("attach", &session(&attach));
    tmux.shows("attach", "gw$ ");
    tmux.keys("attach", &["echo inside $SLURM_JOB_ID on $SLURMD_NODENAME; exit", "Enter"]);
    let screen = tmux.shows("attach", "exited 0");
    assert!(screen.contains(&format!("inside {running} on e2e-node-2")), "{screen}");
    let o = shim("srun", "dev:mallory").args([&format!("--jobid={running}"), "--pty", "/bin/sh"]).output().unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && said.contains("permission"), "another user attached: {said}");
    tool("scancel", &[&running]);

    // salloc --no-shell: the allocation outlives salloc, for srun --jobid.
    let o = shim("salloc", "dev:root").args(["--no-shell", "-N", "2"]).output().unwrap();
    let said = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{said}");
    let held = said.split("Granted job allocation ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap();
    assert_eq!(tool("squeue", &["-h", "-j", held, "-o", "%t"]).trim(), "R", "the allocation was not held");
    let said = tool("srun", &[&format!("--jobid={held}"), "-l", "sh", "-c", "echo in $SLURM_JOB_ID"]);
    assert!(said.contains(&format!("0: in {held}")) && said.contains(&format!("1: in {held}")), "{said}");
    tool("scancel", &[held]);
}

/// scontrol suspend/resume of a 2-node batch job whose srun step runs on
/// both nodes: only an admin may suspend; every task on both nodes stops
/// (and the job shows S and SUSPENDED) until it is resumed; the events
/// record both; a suspended job is cancelled like any other.
fn suspend_and_resume_through_the_shims(endpoints: &str, work: &Path, shim: &dyn Fn(&str, &str) -> Command) {
    let tool = |name: &str, args: &[&str]| {
        let o = shim(name, "dev:root").args(args).output().unwrap();
        assert!(o.status.success(), "{name} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    // srun's steps in the history: sacct's ID.N lines, each with its own
    // state, exit code and nodes, and their events.
    let two = tool("sbatch", &["--parsable", "-N", "2", "--wrap", "srun true; srun -N1 sh -c 'exit 3' || true"]);
    let two = two.trim().to_string();
    eventually("the two-step job never completed", || {
        tool("sacct", &["-X", "-j", &two, "-n", "-P", "-o", "State"]).trim() == "COMPLETED"
    });
    let lines = tool("sacct", &["-j", &two, "-n", "-P", "-o", "JobID,JobName,State,ExitCode,NNodes"]);
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(
        lines,
        [
            format!("{two}|wrap|COMPLETED|0:0|2"),
            format!("{two}.batch|batch|COMPLETED|0:0|1"),
            format!("{two}.0|true|COMPLETED|0:0|2"),
            format!("{two}.1|sh|FAILED|3:0|1"),
        ]
    );
    let o = cli(endpoints, &["events", "--from", "1", "--job", &two, "--kinds", "step_ended", "--count", "2"], work);
    let said = stdout(&o);
    assert!(
        said.contains(&format!("job {two}.0 COMPLETED")) && said.contains(&format!("job {two}.1 FAILED")),
        "{said}"
    );

    // scancel --signal: the batch shell only (-b), then the steps (the
    // default, not the batch shell).
    let script = "trap 'echo batch >> sig-b' USR1; \
                  srun sh -c \"trap 'echo step >> sig-s' USR1; touch sig-ready; while :; do sleep 0.2; done\" & \
                  while :; do sleep 0.2; done";
    let sig = tool("sbatch", &["--parsable", "-t", "10", "--wrap", script]).trim().to_string();
    eventually("the signalled job's step never started", || work.join("sig-ready").exists());
    std::thread::sleep(Duration::from_millis(500));
    tool("scancel", &["-b", "--signal=USR1", &sig]);
    eventually("the batch shell never got its signal", || work.join("sig-b").exists());
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!work.join("sig-s").exists(), "--batch reached a step");
    tool("scancel", &["-s", "usr1", &sig]);
    eventually("the step never got its signal", || work.join("sig-s").exists());
    std::thread::sleep(Duration::from_millis(1500));
    let batch_got = std::fs::read_to_string(work.join("sig-b")).unwrap();
    assert_eq!(batch_got.lines().count(), 1, "the default reached the batch shell: {batch_got}");
    let o = shim("scancel", "dev:mallory").args(["-s", "USR1", &sig]).output().unwrap();
    assert!(!o.status.success(), "another user signalled the job");
    tool("scancel", &[&sig]);

    let step = "srun sh -c 'echo $$ > pid-$SLURM_PROCID; while :; do echo t >> ticks-$SLURM_PROCID; sleep 0.1; done'";
    let id = tool("sbatch", &["--parsable", "-N", "2", "-t", "30", "--wrap", step]).trim().to_string();
    let ticks = |rank: u32| std::fs::read_to_string(work.join(format!("ticks-{rank}"))).map_or(0, |t| t.len());
    eventually("the step never ticked on both nodes", || ticks(0) > 0 && ticks(1) > 0);
    let step_state = || tool("sacct", &["-j", &id, "-n", "-P", "-o", "JobID,State"]);
    assert!(step_state().contains(&format!("{id}.0|RUNNING")), "{}", step_state());
    let o = shim("scontrol", "dev:mallory").args(["suspend", &id]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("operators and admins"), "{err}");
    assert!(tool("scontrol", &["suspend", &id]).contains("suspended"));
    assert_eq!(tool("squeue", &["-h", "-j", &id, "-o", "%t"]).trim(), "S");
    assert_eq!(tool("sacct", &["-X", "-j", &id, "-n", "-P", "-o", "State"]).trim(), "SUSPENDED");
    let still = || {
        let before = (ticks(0), ticks(1));
        std::thread::sleep(Duration::from_millis(800));
        before == (ticks(0), ticks(1))
    };
    eventually("the tasks never stopped on both nodes", still);
    let stopped_at = (ticks(0), ticks(1));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!((ticks(0), ticks(1)), stopped_at, "a suspended job's tasks ran on");
    let o = shim("scontrol", "dev:root").args(["suspend", &id]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("already suspended"));
    assert!(tool("scontrol", &["resume", &id]).contains("resumed"));
    assert_eq!(tool("squeue", &["-h", "-j", &id, "-o", "%t"]).trim(), "R");
    eventually("the tasks never ran again on both nodes", || ticks(0) > stopped_at.0 && ticks(1) > stopped_at.1);
    let o =
        cli(endpoints, &["events", "--from", "1", "--job", &id, "--kinds", "suspended,resumed", "--count", "2"], work);
    let said = stdout(&o);
    assert!(said.contains("suspended") && said.contains("SUSPENDED") && said.contains("resumed"), "{said}");
    assert!(tool("scontrol", &["suspend", &id]).contains("suspended"));
    tool("scancel", &[&id]);
    eventually("the suspended job was never cancelled", || {
        tool("sacct", &["-X", "-j", &id, "-n", "-P", "-o", "State"]).trim() == "CANCELLED"
    });
    assert!(step_state().contains(&format!("{id}.0|CANCELLED")), "a running step ends with its job: {}", step_state());
    // Its tasks end (a stop continues them so that SIGTERM takes), not stay stopped.
    for rank in 0..2 {
        let pid: i32 = std::fs::read_to_string(work.join(format!("pid-{rank}"))).unwrap().trim().parse().unwrap();
        eventually("a cancelled suspended job's task never ended", || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
        });
    }

    // QOS preempt mode SUSPEND: a scavenger job on all of a node's GPUs is
    // suspended (its task stops) when an urgent job needs them, the urgent
    // job runs on those GPUs, and the scavenger continues once it ended.
    for args in [
        ["qos", "add", "scavenger", "--preempt-mode", "suspend"].as_slice(),
        ["qos", "add", "urgent", "--priority", "100", "--preempt", "scavenger"].as_slice(),
    ] {
        let o = cli(endpoints, &[&["admin"], args].concat(), work);
        assert!(o.status.success(), "admin {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let node = "e2e-node-1";
    let scav = "while :; do echo t >> scav-ticks; sleep 0.1; done";
    let low =
        tool("sbatch", &["--parsable", "-q", "scavenger", "-w", node, "--gpus-per-node=4", "-t", "30", "--wrap", scav]);
    let low = low.trim().to_string();
    let scav_ticks = || std::fs::read_to_string(work.join("scav-ticks")).map_or(0, |t| t.len());
    eventually("the scavenger never ticked", || scav_ticks() > 0);
    let urgent = "echo $CUDA_VISIBLE_DEVICES > urgent-gpus; sleep 3";
    let high = tool("sbatch", &["--parsable", "-q", "urgent", "-w", node, "--gpus-per-node=4", "--wrap", urgent]);
    let high = high.trim().to_string();
    eventually("the urgent job never ran", || work.join("urgent-gpus").exists());
    assert_eq!(tool("squeue", &["-h", "-j", &low, "-o", "%t"]).trim(), "S", "the victim is suspended, not requeued");
    let shown = tool("scontrol", &["show", "job", &low]);
    assert!(shown.contains(&format!("preempted by job {high}")), "{shown}");
    let o = shim("scontrol", "dev:root").args(["resume", &low]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("resumes by itself"), "an operator resumed a victim early");
    let paused = scav_ticks();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(scav_ticks(), paused, "the victim ran on the preemptor's GPUs");
    eventually("the urgent job never completed", || {
        tool("sacct", &["-X", "-j", &high, "-n", "-P", "-o", "State"]).trim() == "COMPLETED"
    });
    eventually("the victim never resumed", || scav_ticks() > paused);
    assert_eq!(tool("squeue", &["-h", "-j", &low, "-o", "%t"]).trim(), "R");
    tool("scancel", &[&low]);
    eventually("the scavenger was never cancelled", || {
        tool("sacct", &["-X", "-j", &low, "-n", "-P", "-o", "State"]).trim() == "CANCELLED"
    });
}

/// Licenses and advance reservations through Slurm's commands: seats held by
/// running jobs, a job beyond them waiting with the reason Licenses; a
/// reservation created with scontrol, its node shown `resv`, a job in it
/// run there, another job kept off the node until it is deleted.
fn reservations_and_licenses_through_the_shims(endpoints: &str, work: &Path, shim: &dyn Fn(&str, &str) -> Command) {
    let tool = |name: &str, args: &[&str]| {
        let o = shim(name, "dev:root").args(args).output().unwrap();
        assert!(o.status.success(), "{name} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let state_of = |id: &str| tool("sacct", &["-X", "-j", id, "-n", "-P", "-o", "State"]).trim().to_string();
    let o = cli(endpoints, &["admin", "license", "wandb", "1"], work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let holder = tool("sbatch", &["--parsable", "-L", "wandb", "--wrap", "sleep 60"]).trim().to_string();
    let waiter = tool("sbatch", &["--parsable", "--licenses=wandb:1", "--wrap", "true"]).trim().to_string();
    eventually("the license holder never started", || state_of(&holder) == "RUNNING");
    eventually("the second job never waited for the license", || {
        tool("squeue", &["-h", "-j", &waiter, "-o", "%t|%r|%W"]).trim() == "PD|Licenses|wandb:1"
    });
    let lic = tool("scontrol", &["show", "lic"]);
    assert!(lic.contains("LicenseName=wandb") && lic.contains("Total=1 Used=1 Free=0"), "{lic}");
    let o = shim("sbatch", "dev:root").args(["-L", "comsol", "--wrap", "true"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("invalid license specification"), "{err}");
    tool("scancel", &[&holder]);
    eventually("the license never passed to the waiting job", || state_of(&waiter) == "COMPLETED");

    // A reservation of one node for root, for ten minutes from now.
    let made = tool(
        "scontrol",
        &[
            "create",
            "reservation",
            "ReservationName=e2e",
            "StartTime=now",
            "Duration=10:00",
            "Nodes=e2e-node-2",
            "Users=root",
        ],
    );
    assert!(made.contains("Reservation created: e2e"), "{made}");
    let shown = tool("scontrol", &["show", "reservation", "e2e"]);
    assert!(
        shown.contains("ReservationName=e2e") && shown.contains("Nodes=e2e-node-2") && shown.contains("State=ACTIVE"),
        "{shown}"
    );
    let o = shim("scontrol", "dev:mallory")
        .args(["create", "reservation", "ReservationName=m", "Duration=5", "Nodes=e2e-node-1", "Users=mallory"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("operator or admin"), "{err}");
    eventually("sinfo never showed the reserved node", || {
        tool("sinfo", &["-N", "-h", "-o", "%N %t"]).lines().any(|l| l.trim() == "e2e-node-2 resv")
    });
    let inside = tool("sbatch", &["--parsable", "--reservation=e2e", "-t", "5", "--wrap", "echo in $SLURMD_NODENAME"])
        .trim()
        .to_string();
    let outside = tool("sbatch", &["--parsable", "-w", "e2e-node-2", "-t", "60", "--wrap", "true"]).trim().to_string();
    eventually("the reservation's job never completed", || state_of(&inside) == "COMPLETED");
    let said = std::fs::read_to_string(work.join(format!("slurm-{inside}.out"))).unwrap();
    assert_eq!(said.trim(), "in e2e-node-2");
    let row = tool("sacct", &["-X", "-j", &inside, "-n", "-P", "-o", "State,Reservation"]);
    assert_eq!(row.trim(), "COMPLETED|e2e");
    let listed = tool("squeue", &["-h", "-R", "e2e", "-t", "all", "-o", "%i %v"]);
    assert_eq!(listed.trim(), format!("{inside} e2e"), "squeue -R lists the reservation's jobs");
    let shown = stdout(&cli(endpoints, &["show", &outside, "--json"], work));
    assert!(shown.contains("\"state\": \"PENDING\""), "a job ran on a reserved node: {shown}");
    let o = shim("sbatch", "dev:mallory").args(["--reservation=e2e", "--wrap", "true"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("access denied to requested reservation"), "{err}");
    tool("scontrol", &["delete", "reservation", "e2e"]);
    assert!(tool("scontrol", &["show", "reservation"]).contains("No reservations in the system"));
    eventually("the job never ran once the reservation was gone", || state_of(&outside) == "COMPLETED");
    // -w shorter than -N: the listed node and another, as Slurm adds them.
    let both = tool("sbatch", &["--parsable", "-N", "2", "-w", "e2e-node-2", "--wrap", "echo $SLURM_JOB_NODELIST"]);
    let both = both.trim().to_string();
    eventually("the -w/-N job never completed", || state_of(&both) == "COMPLETED");
    let said = std::fs::read_to_string(work.join(format!("slurm-{both}.out"))).unwrap();
    assert_eq!(said.trim(), "e2e-node-[1-2]");
}

/// The admin commands (TOML import/export, object edits) and the scheduler's
/// submit options as a user types them.
fn policy_and_scheduler_options_through_the_cli(endpoints: &str, work: &Path) {
    let ok = |args: &[&str]| {
        let o = cli(endpoints, args, work);
        assert!(o.status.success(), "gangway {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let fails = |args: &[&str]| {
        let o = cli(endpoints, args, work);
        assert_eq!(o.status.code(), Some(1), "gangway {args:?} should fail: {}", stdout(&o));
        let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    // The dev cluster runs as root here: the file (the whole policy) says so.
    let policy = r#"
topology_levels = ["rack"]
allow_root_jobs = true

[partitions.gpu]
nodes = ["e2e-node-[1-2]"]
default = true
max_time_s = 86400

[partitions.debug]
nodes = ["e2e-node-2"]
max_time_s = 3600
priority_tier = 2

[accounts.ml]
shares = 3
quota = { max_running_gpus = 4 }

[accounts.research]

[users.root]
accounts = ["ml", "research"]

[qos.high]
priority = 100
"#;
    std::fs::write(work.join("policy.toml"), policy).unwrap();
    assert!(ok(&["admin", "import", "policy.toml"]).contains("imported"));
    let exported = ok(&["admin", "export"]);
    assert!(exported.contains("[partitions.debug]") && exported.contains("max_running_gpus = 4"), "{exported}");
    std::fs::write(work.join("exported.toml"), &exported).unwrap();
    assert!(ok(&["admin", "import", "exported.toml"]).contains("already matches"), "export/import must round-trip");
    let err = fails(&["admin", "account", "add", "bad", "--parent", "nope"]);
    assert!(err.contains("accounts.bad.parent"), "{err}");
    assert!(ok(&["admin", "account", "set", "ml", "--max-gpus", "8"]).contains("updated"));
    assert!(ok(&["admin", "account", "list"]).contains("max_running_gpus = 8"));
    // Roles and the user map (data format 6), and a clear error for a bad map entry.
    assert!(ok(&["admin", "set", "--operators", "oncall", "--user-domains", "corp.example"]).contains("updated"));
    assert!(ok(&["admin", "coordinators", "ml", "--set", "carol,dave"]).contains("coordinators of ml set"));
    let coords = ok(&["admin", "coordinators"]);
    assert!(coords.contains("ml") && coords.contains("carol,dave"), "{coords}");
    let err = fails(&["admin", "set", "--user-map", "ci-bot"]);
    assert!(err.contains("--user-map") && err.contains("NAME=USER"), "{err}");
    let err = fails(&["admin", "coordinators", "nope", "--set", "carol"]);
    assert!(err.contains("coordinators.nope"), "{err}");
    let exported = ok(&["admin", "export"]);
    assert!(exported.contains("operators = [\"oncall\"]") && exported.contains("[coordinators]"), "{exported}");
    assert!(exported.contains("allow_root_jobs = true"), "{exported}");
    let err = fails(&["submit", "-p", "debug", "-t", "2-00:00:00", "--", "true"]);
    assert!(err.contains("time_limit_s") && err.contains("debug"), "{err}");
    let err = fails(&["submit", "-A", "nope", "--", "true"]);
    assert!(err.contains("account"), "{err}");

    // Held with a partition, account, QOS and GPUs; `why` says so; release runs it.
    let id = ok(&[
        "submit",
        "--parsable",
        "-p",
        "debug",
        "-A",
        "research",
        "-q",
        "high",
        "-t",
        "10",
        "--gpus",
        "2",
        "-H",
        "--",
        "true",
    ]);
    let id = id.trim();
    assert!(ok(&["why", id]).contains("JobHeldUser"));
    assert!(ok(&["queue"]).contains("(JobHeldUser)"));
    ok(&["release", id]);
    eventually("the released job never completed", || {
        stdout(&cli(endpoints, &["show", id, "--json"], work)).contains("\"state\": \"COMPLETED\"")
    });
    let shown = stdout(&cli(endpoints, &["show", id, "--json"], work));
    assert!(shown.contains("\"account\": \"research\"") && shown.contains("e2e-node-2"), "{shown}");

    // An array with a throttle, as Slurm prints and names it.
    let out = ok(&["submit", "--array", "0-2%1", "--wrap", "echo task $SLURM_ARRAY_TASK_ID"]);
    assert!(out.contains("array of 3"), "{out}");
    let first: u64 = out.split_whitespace().nth(3).unwrap().parse().unwrap();
    eventually("the array never finished", || {
        (0..3).all(|i| {
            std::fs::read_to_string(work.join(format!("slurm-{first}_{i}.out")))
                .is_ok_and(|s| s.trim() == format!("task {i}"))
        })
    });
    // -n spreads tasks over the nodes; an uneven split is refused.
    let id = ok(&["submit", "--parsable", "-N", "2", "-n", "4", "--wrap", "echo $SLURM_NTASKS $SLURM_NTASKS_PER_NODE"]);
    let id = id.trim().to_string();
    eventually("the task-count job never finished", || {
        std::fs::read_to_string(work.join(format!("slurm-{id}.out"))).is_ok_and(|s| s.trim() == "4 2")
    });
    let err = fails(&["submit", "-N", "2", "-n", "3", "--", "true"]);
    assert!(err.contains("--ntasks") && err.contains("evenly"), "{err}");
    let shares = ok(&["admin", "shares"]);
    assert!(shares.contains("research") && shares.contains("ml"), "{shares}");
}

/// The README's first command: `gangway dev` (replicas and simulated nodes in
/// one process) runs a Slurm batch script as a new user would submit it,
/// with no links installed: the script runs once, srun reaches both nodes.
#[test]
fn the_dev_cluster_runs_a_batch_script() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path();
    // The dev cluster takes consecutive ports from its base: retry elsewhere
    // if one of them is taken.
    let mut dev = None;
    for _ in 0..5 {
        let port = free_port();
        let args = ["dev", "--port", &port.to_string(), "--metrics-port", "0"];
        let log = std::fs::File::create(work.join("dev.log")).unwrap();
        let mut child =
            Command::new(GANGWAY).args(args).current_dir(work).stdin(Stdio::null()).stdout(log).spawn().unwrap();
        let endpoints = (0..3).map(|i| format!("127.0.0.1:{}", port + i)).collect::<Vec<_>>().join(",");
        let deadline = Instant::now() + WAIT;
        let up = loop {
            if child.try_wait().unwrap().is_some() {
                break false;
            }
            let o = dev_cli(&endpoints, &["nodes", "--json"], work);
            if stdout(&o).matches("\"state\": \"UP\"").count() == 2 {
                break true;
            }
            assert!(Instant::now() < deadline, "the dev cluster never came up");
            std::thread::sleep(Duration::from_millis(200));
        };
        if up {
            dev = Some((Procs(vec![child]), endpoints));
            break;
        }
    }
    let (mut procs, endpoints) = dev.expect("the dev cluster did not start on any port");
    std::fs::write(
        work.join("job.sh"),
        "#!/bin/bash\n\
         #SBATCH -N 2 --gpus-per-node=1 -J devjob\n\
         echo \"batch on $SLURMD_NODENAME\"\n\
         srun -l bash -c 'echo rank $SLURM_PROCID on $SLURMD_NODENAME'\n",
    )
    .unwrap();
    let o = dev_cli(&endpoints, &["sbatch", "job.sh"], work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = stdout(&o).trim().strip_prefix("Submitted batch job ").unwrap().to_string();
    eventually("the batch job never completed", || {
        stdout(&dev_cli(&endpoints, &["sacct", "-X", "-j", &id, "-n", "-P", "-o", "State"], work)).trim() == "COMPLETED"
    });
    let out = std::fs::read_to_string(work.join(format!("slurm-{id}.out"))).unwrap();
    assert_eq!(out.matches("batch on dev-node-").count(), 1, "{out}");
    for rank in 0..2 {
        assert!(out.contains(&format!("{rank}: rank {rank} on dev-node-")), "{out}");
    }
    assert!(out.contains("on dev-node-1") && out.contains("on dev-node-2"), "{out}");
    // Ctrl-C stops it cleanly.
    let dev = &mut procs.0[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(dev.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(s) = dev.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the dev cluster did not stop on Ctrl-C");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "{status:?}");
}

/// The accounting store's connection over TLS with libpq's `sslmode`:
/// `verify-full` connects to a server whose certificate the CA signed for
/// the address it is reached at, and the server sees the session encrypted;
/// a name the certificate does not carry fails `verify-full` but passes
/// `verify-ca`; a CA that did not sign fails both; `disable` stays plaintext.
#[test]
fn the_accounting_store_speaks_tls_to_postgresql() {
    use gangway_controller::accounting::store::Store;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    gangway_proto::pki::create_ca(&ca, "PostgreSQL test CA", 1).unwrap();
    let other_ca = dir.path().join("other-ca");
    gangway_proto::pki::create_ca(&other_ca, "Another CA", 1).unwrap();
    let pg = Postgres::start_tls(&ca);
    let root = |d: &Path| d.join("ca.pem").display().to_string();
    let url = |host: &str, mode: &str, ca: &Path, app: &str| {
        format!(
            "postgres://gangway@{host}:{}/postgres?sslmode={mode}&sslrootcert={}&application_name={app}",
            pg.port,
            root(ca)
        )
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let encrypted = |app: &str| {
        pg.query(&format!(
            "SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = '{app}'"
        ))
    };
    let full = rt.block_on(Store::connect(&url("127.0.0.1", "verify-full", &ca, "full"))).expect("verify-full");
    assert_eq!(encrypted("full").trim(), "t", "the verified session is not encrypted");
    let e = rt
        .block_on(Store::connect(&url("localhost", "verify-full", &ca, "name")))
        .err()
        .expect("a name the certificate lacks");
    assert!(format!("{e:#}").contains("certificate"), "{e:#}");
    let by_ca =
        rt.block_on(Store::connect(&url("localhost", "verify-ca", &ca, "ca"))).expect("verify-ca ignores the name");
    assert_eq!(encrypted("ca").trim(), "t");
    for mode in ["verify-ca", "verify-full"] {
        let e = rt.block_on(Store::connect(&url("127.0.0.1", mode, &other_ca, "other"))).err().expect("another CA");
        assert!(format!("{e:#}").contains("certificate"), "{mode}: {e:#}");
    }
    let plain = rt
        .block_on(Store::connect(&format!(
            "postgres://gangway@127.0.0.1:{}/postgres?sslmode=disable&application_name=plain",
            pg.port
        )))
        .expect("disable");
    assert_eq!(encrypted("plain").trim(), "f");
    drop((full, by_ca, plain));
}

/// A private PostgreSQL server for one test: Debian's binaries, a throwaway
/// data directory, trust authentication on loopback only; stopped (fast)
/// when dropped. Run as the `postgres` user when the tests run as root
/// (PostgreSQL refuses root).
struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Postgres {
    fn bin_dir() -> PathBuf {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map(|d| d.flatten().map(|e| e.path().join("bin")).filter(|p| p.join("initdb").is_file()).collect())
            .unwrap_or_default();
        found.sort();
        found.pop().expect("PostgreSQL is not installed (deploy/setup-debian.sh installs Debian's postgresql)")
    }

    /// Runs a PostgreSQL program as the server's owner.
    fn command(&self, program: &str) -> Command {
        let exe = self.bin.join(program);
        if nix_is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    fn start() -> Postgres {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new().prefix("gangway-pg-").tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        if nix_is_root() {
            let o = Command::new("chown").arg("postgres:postgres").arg(&data).output().unwrap();
            assert!(o.status.success(), "chown: {}", String::from_utf8_lossy(&o.stderr));
        }
        let pg = Postgres { bin: Self::bin_dir(), data, port: free_port(), _dir: dir };
        let o = pg
            .command("initdb")
            .args(["-A", "trust", "-U", "gangway", "-E", "UTF8", "--no-sync", "-D"])
            .arg(&pg.data)
            .output()
            .unwrap();
        assert!(o.status.success(), "initdb: {}", String::from_utf8_lossy(&o.stderr));
        pg.run();
        pg
    }

    /// [`Postgres::start`] serving TLS with a certificate for 127.0.0.1
    /// (only: not for `localhost`) signed by the CA in `ca_dir`.
    fn start_tls(ca_dir: &Path) -> Postgres {
        let pg = Postgres::start();
        pg.stop();
        let req = gangway_proto::pki::CertRequest {
            principal: gangway_proto::tls::Principal::new(gangway_proto::tls::Role::Server, "postgres").unwrap(),
            hosts: vec!["127.0.0.1".into()],
            days: 1,
            backdate_days: 0,
            cluster: "gangway".into(),
        };
        let (cert, key) = gangway_proto::pki::create_cert(ca_dir, ca_dir, &req).unwrap();
        for (from, to) in [(&cert, "server.crt"), (&key, "server.key")] {
            std::fs::copy(from, pg.data.join(to)).unwrap();
            if nix_is_root() {
                let o = Command::new("chown").arg("postgres:postgres").arg(pg.data.join(to)).output().unwrap();
                assert!(o.status.success(), "chown: {}", String::from_utf8_lossy(&o.stderr));
            }
        }
        let conf = "\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n";
        let mut f = std::fs::OpenOptions::new().append(true).open(pg.data.join("postgresql.conf")).unwrap();
        std::io::Write::write_all(&mut f, conf.as_bytes()).unwrap();
        pg.run();
        pg
    }

    /// Starts (or starts again) the server and waits until it answers.
    fn run(&self) {
        let log = self.data.join("server.log");
        let opts = format!("-p {} -k {} -c listen_addresses=127.0.0.1", self.port, self.data.display());
        let o = self
            .command("pg_ctl")
            .args(["start", "-w", "-t", "60", "-o", &opts, "-l"])
            .arg(&log)
            .arg("-D")
            .arg(&self.data)
            .output()
            .unwrap();
        assert!(o.status.success(), "pg_ctl start: {}", String::from_utf8_lossy(&o.stderr));
    }

    /// Stops the server (fast: sessions are cut, as in an outage).
    fn stop(&self) {
        let _ = self.command("pg_ctl").args(["stop", "-m", "fast", "-w", "-D"]).arg(&self.data).output();
    }

    fn url(&self) -> String {
        format!("postgres://gangway@127.0.0.1:{}/postgres", self.port)
    }

    /// One query's rows, `|`-separated.
    fn query(&self, sql: &str) -> String {
        self.try_query(sql).unwrap_or_else(|e| panic!("psql {sql}: {e}"))
    }

    fn try_query(&self, sql: &str) -> Result<String, String> {
        let port = self.port.to_string();
        let args = ["-h", "127.0.0.1", "-p", &port, "-U", "gangway", "-d", "postgres", "-At", "-c", sql];
        let o = Command::new(self.bin.join("psql")).args(args).output().unwrap();
        match o.status.success() {
            true => Ok(stdout(&o)),
            false => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

fn nix_is_root() -> bool {
    // SAFETY-free: `id -u` rather than libc, to keep this test file free of unsafe.
    Command::new("id").arg("-u").output().map(|o| stdout(&o).trim() == "0").unwrap_or(false)
}

/// `gangway accounting` into a real PostgreSQL while things fail: the
/// accounting service is killed and restarted, the leader is killed, the
/// database stops and comes back. Every job ends up stored once, with its
/// final state, its events once each, and its usage.
#[test]
fn accounting_stores_every_job_once_across_failures() {
    let (_agent_bin, agent_exe) = agent_bin();
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let pg = Postgres::start();
    let (addrs, peers, endpoints) = three_replicas();
    let tls = pki().to_str().unwrap().to_string();
    let url = pg.url();
    let mut controllers = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let (id, data) = ((i + 1).to_string(), dir.path().join(format!("c{}", i + 1)));
        let args = ["controller", "--id", &id, "--listen", addr, "--peers", &peers, "--data-dir"];
        let args: Vec<&str> = args
            .into_iter()
            .chain([data.to_str().unwrap(), "--tls-dir", &tls, "--bootstrap-admin", "root", "--allow-root-jobs"])
            .chain(["--private-jobs", "--accounting-database", &url, "--accounting-identity", "client:accounting"])
            .collect();
        controllers.push(Some(Procs(vec![spawn(&args, &dir.path().join(format!("c{}.log", i + 1)))])));
    }
    // Two agents, 4 simulated GPUs each.
    let mut agents = Procs(Vec::new());
    for n in [2, 3] {
        let agent = agent_args(&endpoints, n, dir.path());
        let agent: Vec<&str> = agent.iter().map(String::as_str).collect();
        agents.0.push(spawn_exe(&agent_exe, &agent, &dir.path().join(format!("agent-{n}.log"))));
    }
    eventually("the agents never registered", || {
        stdout(&cli(&endpoints, &["nodes", "--json"], &work)).matches("\"state\": \"UP\"").count() == 2
    });
    let accounting = || accounting_service(&pg.url(), &endpoints, &dir.path().join("accounting.log"));
    let mut service = Procs(vec![accounting()]);
    // It stores what happens from its first start on (and every job the
    // state holds then): wait until it has its place in the log.
    eventually("the accounting service never started", || {
        pg.try_query("SELECT count(*) FROM ingest_cursor").is_ok_and(|n| n.trim() == "1")
    });
    let submit = |args: &[&str]| submit_parsable(&endpoints, args, &work);
    // The state keeps 8 finished jobs: the test runs more, so sacct, show,
    // sreport and seff must find the others in the database. (The setting
    // needs data format 13, which a new cluster reaches by itself.)
    eventually("the policy never took finished_jobs_kept", || {
        cli(&endpoints, &["admin", "set", "--finished-jobs-kept", "8"], &work).status.success()
    });
    // The simulated GPUs' load, which the agent samples into each job's usage.
    let load: String = (0..4).map(|g| format!("{g} 70 30000\n")).collect();
    for n in [2, 3] {
        std::fs::write(dir.path().join(format!("agent-{n}")).join("gpu-load"), &load).unwrap();
    }
    let mut jobs = Vec::new();
    let (mut gpu_jobs, mut burners) = (Vec::new(), Vec::new());
    // The service's identity reads and reports, and can do nothing else: no
    // cancel, drain or policy edit (an operator's certificate could).
    let victim = submit(&["--", "sleep", "60"]);
    let as_accounting = |args: &[&str]| {
        as_user(Command::new(GANGWAY).args(args), "accounting")
            .env("GANGWAY_ENDPOINTS", &endpoints)
            .current_dir(&work)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    for args in [
        vec!["cancel".to_string(), victim.to_string()],
        vec!["node".into(), "drain".into(), "e2e-node-2".into(), "--reason".into(), "x".into()],
        vec!["admin".into(), "set".into(), "--private-jobs".into(), "false".into()],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = as_accounting(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("permission"), "the accounting identity could {args:?}: {err}");
    }
    let shown = stdout(&as_accounting(&["show", &victim.to_string(), "--json"]));
    assert!(shown.contains("\"state\""), "the accounting identity does not see root's job: {shown}");
    let o = cli(&endpoints, &["cancel", &victim.to_string()], &work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    jobs.push(victim);
    let mut round = |jobs: &mut Vec<u64>| {
        // Four seconds: the agent's first sample comes a second in
        // (`usage::FIRST_SAMPLE`); with two, a busy machine could end the
        // job before it, and its load would be unmeasured.
        let gpu = submit(&["--gpus", "2", "--", "sleep", "4"]);
        let burn =
            // A fixed amount of work (about two seconds of a core here), not
            // a fixed time: on a busy machine the job takes longer, its CPU
            // time does not shrink.
            submit(&["-J", "burn", "--", "sh", "-c", "i=0; while [ $i -lt 2000000 ]; do i=$((i+1)); done"]);
        jobs.extend([gpu, burn]);
        gpu_jobs.push(gpu);
        burners.push(burn);
        jobs.push(submit(&["--", "false"]));
        jobs.push(submit(&["-J", "quick", "--", "true"]));
    };
    for _ in 0..3 {
        round(&mut jobs);
    }
    // The accounting service dies mid-stream and comes back.
    drop(service);
    round(&mut jobs);
    service = Procs(vec![accounting()]);
    round(&mut jobs);
    // The leader dies.
    let leader = stdout(&cli(&endpoints, &["cluster", "status", "--json"], &work));
    let leader_id: usize = serde_leader(&leader);
    controllers[leader_id - 1] = None;
    round(&mut jobs);
    // The database goes away for a while, then comes back.
    pg.stop();
    round(&mut jobs);
    std::thread::sleep(Duration::from_secs(2));
    pg.run();
    round(&mut jobs);
    // A pending job cancelled before it ever ran.
    let held = submit(&["-H", "--", "true"]);
    let o = cli(&endpoints, &["cancel", &held.to_string()], &work);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    jobs.push(held);

    let state_of = |id: u64| -> String {
        let shown = stdout(&cli(&endpoints, &["show", &id.to_string(), "--json"], &work));
        shown.split("\"state\": \"").nth(1).and_then(|s| s.split('"').next()).unwrap_or("").to_string()
    };
    let terminal = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "DEADLINE"];
    eventually("the jobs never all ended", || jobs.iter().all(|j| terminal.contains(&state_of(*j).as_str())));
    let states: Vec<String> = jobs.iter().map(|j| state_of(*j)).collect();
    let want: String = jobs.iter().zip(&states).map(|(j, s)| format!("{j}|{s}\n")).collect::<Vec<_>>().concat();
    let ids = jobs.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let stored = || pg.query(&format!("SELECT job_id, state FROM jobs WHERE job_id IN ({ids}) ORDER BY job_id"));
    let deadline = Instant::now() + WAIT;
    while stored() != want {
        assert!(Instant::now() < deadline, "the store never caught up:\n{}\nwant:\n{want}", stored());
        std::thread::sleep(Duration::from_millis(300));
    }
    // More jobs ran than the state keeps: once the service says it has
    // stored them, the state lets the oldest go, and they are read from the
    // database.
    let from_db = || {
        let shown = |j: &u64| stdout(&cli(&endpoints, &["show", &j.to_string(), "--json"], &work));
        jobs.iter().filter(|j| shown(j).contains("\"source\": \"accounting\"")).count()
    };
    eventually("the state never let the stored jobs go", || from_db() >= jobs.len() - 8);
    drop(service);
    // Once each: one row per job, one `submitted` and one `finished` event each.
    let n = jobs.len();
    assert_eq!(pg.query("SELECT count(*) FROM jobs").trim(), n.to_string());
    // No event stored twice, even at another place within its log index.
    let twice = pg.query("SELECT log_index, job_id, kind FROM events GROUP BY 1, 2, 3 HAVING count(*) > 1");
    assert_eq!(twice, "", "events stored twice");
    let per_job = pg.query(&format!(
        "SELECT job_id, sum((kind = 'submitted')::int), sum((kind = 'finished')::int) FROM events \
         WHERE job_id IN ({ids}) GROUP BY job_id ORDER BY job_id"
    ));
    let want_events: String = jobs.iter().map(|j| format!("{j}|1|1\n")).collect::<Vec<_>>().concat();
    assert_eq!(per_job, want_events, "events per job (submitted, finished)");
    // Usage: each 2-GPU `sleep 4` held 2 GPUs for at least two seconds, at
    // the load file's 70%; each burner used CPU time, as its agent measured.
    let rounds = gpu_jobs.len();
    let held = pg.query("SELECT count(*) FROM jobs WHERE alloc_gpus = 2 AND gpu_seconds >= 4 AND state = 'COMPLETED'");
    let gpu_rows =
        pg.query("SELECT job_id, state, attempts, elapsed_s, gpu_seconds, gpu_util_pct, measured_nodes, cpu_used_ms, mem_peak_mb FROM jobs WHERE alloc_gpus = 2");
    assert_eq!(held.trim(), rounds.to_string(), "GPU jobs with their GPU-seconds:\n{gpu_rows}");
    let loaded =
        pg.query("SELECT count(*) FROM jobs WHERE alloc_gpus = 2 AND gpu_util_pct = 70 AND gpu_mem_peak_mb = 30000");
    assert_eq!(loaded.trim(), rounds.to_string(), "GPU jobs with their sampled load:\n{gpu_rows}");
    // A twentieth of what the work costs on the 2-core VM: any machine
    // measures that much for it, and a job that only waited measures ~0.
    let burnt = pg.query("SELECT count(*) FROM jobs WHERE name = 'burn' AND cpu_used_ms >= 100 AND measured_nodes = 1");
    let burn_rows = pg.query("SELECT job_id, state, attempts, elapsed_s, measured_nodes, cpu_used_ms, mem_peak_mb FROM jobs WHERE name = 'burn'");
    assert_eq!(burnt.trim(), rounds.to_string(), "burners with their CPU time:\n{burn_rows}");
    // seff, for a job only the database holds: its CPU time, and the GPUs' load.
    let seff = |id: u64| {
        let o = cli(&endpoints, &["seff", &id.to_string()], &work);
        assert!(o.status.success(), "seff {id}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let burnt = seff(burners[0]);
    let cpu = burnt.lines().find_map(|l| l.strip_prefix("CPU Utilized: ")).unwrap_or_else(|| panic!("{burnt}"));
    // Two seconds' work of a busy loop: under ten seconds of CPU, and some
    // share of its core-walltime (how much depends on the machine's load).
    assert!(cpu.starts_with("00:00:0"), "the burner's CPU time: {burnt}");
    let eff = burnt.lines().find_map(|l| l.strip_prefix("CPU Efficiency: ")).unwrap_or_else(|| panic!("{burnt}"));
    let pct: f64 = eff.split('%').next().unwrap().parse().unwrap();
    assert!(pct > 0.0, "the burner's CPU efficiency: {burnt}");
    assert!(burnt.contains(&format!("Job ID: {}\n", burners[0])) && burnt.contains("State: COMPLETED (exit code 0)"));
    assert!(burnt.contains("CPU Efficiency: ") && burnt.contains("Memory Utilized: "), "{burnt}");
    // seff knows every job, in the state or the database, with its stored state.
    let stored_states = pg.query(&format!("SELECT job_id, state FROM jobs WHERE job_id IN ({ids})"));
    for row in stored_states.lines() {
        let (id, state) = row.split_once('|').unwrap();
        let report = seff(id.parse().unwrap());
        assert!(report.starts_with(&format!("Job ID: {id}\n")), "{report}");
        assert!(report.contains(&format!("\nState: {state}")), "job {id} is {state} in the database: {report}");
    }
    let gpu = seff(gpu_jobs[0]);
    assert!(gpu.contains("GPUs: 2 (2 per node)\nGPU Utilized: 70.00%"), "{gpu}");
    assert!(gpu.contains("GPU Memory Utilized: 29.30 GB"), "{gpu}");
    let cursor = pg.query("SELECT log_index > 0 FROM ingest_cursor");
    assert_eq!(cursor.trim(), "t");
    // sacct reads what the state no longer holds from the database, as the
    // caller may see it: two jobs only the database knows (an earlier
    // history), one root's and one mallory's.
    pg.query(
        "INSERT INTO jobs (job_id, display_id, name, user_name, account, partition, qos, state, reason, \
         exit_code, submit_time, start_time, end_time, time_limit_s, suspended_ms, attempts, nodes_requested, \
         gpus_per_node, gpu_type, mem_per_node_mb, node_list, alloc_cpus, alloc_gpus, alloc_mem_mb, elapsed_s, \
         cpu_seconds, gpu_seconds, work_dir, last_index) VALUES \
         (900001, '900001', 'old-train', 'root', 'root', 'default', 'normal', 'COMPLETED', '', 0, \
          now() - interval '3 days', now() - interval '3 days', now() - interval '2 days', 86400, 0, 1, 2, 8, \
          'h100', 0, '{e2e-node-1,e2e-node-2}', 16, 16, 0, 86400, 1382400, 1382400, '/tmp', 1), \
         (900002, '900002', 'old-eval', 'mallory', 'root', 'default', 'normal', 'FAILED', '', 1, \
          now() - interval '3 days', now() - interval '3 days', now() - interval '2 days', 86400, 0, 1, 1, 0, \
          '', 0, '{e2e-node-1}', 1, 0, 0, 86400, 86400, 0, '/tmp', 1)",
    );
    let sacct = |user: &str, args: &[&str]| {
        let o = as_user(Command::new(GANGWAY).arg("sacct").args(args), user)
            .env("GANGWAY_ENDPOINTS", &endpoints)
            .current_dir(&work)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "sacct {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let fields = ["-P", "-n", "-X", "-o", "JobID,JobName,User,State,ExitCode,NodeList,Elapsed,AllocCPUS"];
    let old = sacct("root", &[&["-j", "900001"][..], &fields[..]].concat());
    assert_eq!(old, "900001|old-train|root|COMPLETED|0:0|e2e-node-[1-2]|1-00:00:00|16\n");
    let mine = sacct("mallory", &[&["-a", "-S", "2020-01-01"][..], &fields[..]].concat());
    assert_eq!(mine, "900002|old-eval|mallory|FAILED|1:0|e2e-node-1|1-00:00:00|1\n", "mallory sees hers only");
    let all = sacct("root", &[&["-a", "-S", "2020-01-01"][..], &fields[..]].concat());
    assert_eq!(all.lines().count(), jobs.len() + 2, "root sees every job once, state and history merged:\n{all}");
    // sreport sums GPU- and CPU-seconds by account and user over a range,
    // each job's run clipped to it; a user with private jobs sees their own.
    let sreport = |user: &str, args: &[&str]| {
        let o = as_user(Command::new(GANGWAY).arg("sreport").args(args), user)
            .env("GANGWAY_ENDPOINTS", &endpoints)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "sreport {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    let report = ["-P", "-n", "-t", "seconds", "cluster", "AccountUtilizationByUser", "start=now-4days", "end=now"];
    let gpu = sreport("root", &[&["--tres=gres/gpu"][..], &report[..]].concat());
    let lines: Vec<Vec<&str>> = gpu.lines().map(|l| l.split('|').collect()).collect();
    let used = |login: &str| -> u64 {
        lines.iter().find(|c| c[2] == login).map(|c| c[4].parse().unwrap()).unwrap_or_else(|| panic!("{login}: {gpu}"))
    };
    // 900001 held 16 GPUs for a day; the `sleep 1` jobs 2 GPUs for about a second each.
    assert!((1_382_400..1_382_400 + 600).contains(&used("root")), "{gpu}");
    assert_eq!(used("mallory"), 0, "{gpu}");
    assert_eq!(used(""), used("root") + used("mallory"), "the account line is its users' sum: {gpu}");
    let theirs = sreport("mallory", &report);
    let want = "gangway|root|||86400|0\ngangway|root|mallory|mallory|86400|0\n";
    assert_eq!(theirs, want, "mallory's own usage only");
    // sreport cluster Utilization: the GPUs the accounting service saw the
    // node have (4, sampled every minute since it started), and what the
    // jobs held, which is what the stored jobs add up to.
    let util = sreport(
        "root",
        &[
            "-P",
            "-n",
            "-t",
            "seconds",
            "--tres=gres/gpu",
            "cluster",
            "Utilization",
            "start=now-1hours",
            "end=now+1hours",
        ],
    );
    let cells: Vec<u64> = util.trim().split('|').skip(1).map(|c| c.parse().unwrap()).collect();
    let [allocated, down, planned, idle, reported] = cells[..] else { panic!("{util}") };
    let stored: u64 = pg
        .query("SELECT COALESCE(sum(gpu_seconds), 0) FROM jobs WHERE end_time > now() - interval '1 hour'")
        .trim()
        .parse()
        .unwrap();
    assert!(
        allocated >= stored && allocated <= stored + 2 * rounds as u64 + 2,
        "allocated {allocated}, stored {stored}: {util}"
    );
    assert!(reported >= 8 * 60 && reported % 60 == 0 && down == 0 && planned == 0, "{util}");
    // Each figure is rounded on its own.
    assert!(idle.abs_diff(reported.saturating_sub(allocated)) <= 1, "{util}");
    let refused = as_user(Command::new(GANGWAY).args(["sreport", "cluster", "Utilization"]), "mallory")
        .env("GANGWAY_ENDPOINTS", &endpoints)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!refused.status.success(), "with private jobs a user does not see everyone's utilization");
    // Fair share's usage rebuilt from the history (after a disaster
    // restore): 900001's 16 GPUs for a day, decayed over two days, are back.
    let root_gpu_hours = || -> f64 {
        let shares: serde_json::Value =
            serde_json::from_str(&stdout(&cli(&endpoints, &["admin", "shares", "--json"], &work))).unwrap();
        let root = shares.as_array().unwrap().iter().find(|a| a["account"] == "root").cloned().unwrap();
        root["gpu_hours"].as_f64().unwrap()
    };
    assert!(root_gpu_hours() < 1.0, "before: {}", root_gpu_hours());
    let rebuild = |extra: &[&str]| {
        let o = as_user(
            Command::new(GANGWAY).args(["accounting", "rebuild-fairshare", "--database", &pg.url()]).args(extra),
            "root",
        )
        .env("GANGWAY_ENDPOINTS", &endpoints)
        .stdin(Stdio::null())
        .output()
        .unwrap();
        assert!(o.status.success(), "rebuild-fairshare: {}", String::from_utf8_lossy(&o.stderr));
        stdout(&o)
    };
    assert!(rebuild(&["--dry-run"]).contains("nothing changed"));
    assert!(root_gpu_hours() < 1.0, "a dry run changes nothing");
    let done = rebuild(&[]);
    assert!(done.contains(&format!("rebuilt from {} jobs", n + 2 - 1)), "{done}");
    let after = root_gpu_hours();
    assert!((384.0 * 0.75..384.0).contains(&after), "384 GPU-hours two days ago, decayed: {after}");
    // The outage was real: the service saw its writes fail and went on.
    let log = std::fs::read_to_string(dir.path().join("accounting.log")).unwrap();
    assert!(log.contains("retrying"), "the database outage was never noticed:\n{log}");
}

/// The leader's id from `gangway cluster status --json`.
/// A cluster that lost every replica is restored from a backup while
/// `gangway accounting` keeps running: the service meets the new history
/// (its cursor, past the backup's index, names other entries there), stores
/// every job the restored state holds again, and follows the new history
/// from there. Every job, before and after the restore, is stored once,
/// with its events; those run after the backup stay in the store.
#[test]
fn accounting_keeps_every_job_across_a_restore_from_a_backup() {
    let (_agent_bin, agent_exe) = agent_bin();
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let pg = Postgres::start();
    let (addrs, peers, endpoints) = three_replicas();
    let tls = pki().to_str().unwrap().to_string();
    let url = pg.url();
    let start = |generation: &str, restore: Option<&Path>| -> Procs {
        let mut procs = Procs(Vec::new());
        for (i, addr) in addrs.iter().enumerate() {
            let (id, data) = ((i + 1).to_string(), dir.path().join(format!("{generation}-c{}", i + 1)));
            let args = ["controller", "--id", &id, "--listen", addr, "--peers", &peers, "--data-dir"];
            let mut args: Vec<&str> = args
                .into_iter()
                .chain([data.to_str().unwrap(), "--tls-dir", &tls, "--bootstrap-admin", "root", "--allow-root-jobs"])
                .chain(["--accounting-database", &url, "--accounting-identity", "client:accounting"])
                .collect();
            if let Some(file) = restore {
                args.extend(["--restore", file.to_str().unwrap()]);
            }
            let log = dir.path().join(format!("{generation}-c{}.log", i + 1));
            procs.0.push(spawn(&args, &log));
        }
        procs
    };
    let mut controllers = start("lost", None);
    let agent = agent_args(&endpoints, 2, dir.path());
    let agent: Vec<&str> = agent.iter().map(String::as_str).collect();
    let _agent = Procs(vec![spawn_exe(&agent_exe, &agent, &dir.path().join("agent.log"))]);
    eventually("the agent never registered", || {
        stdout(&cli(&endpoints, &["nodes", "--json"], &work)).contains("\"state\": \"UP\"")
    });
    let _service = Procs(vec![accounting_service(&url, &endpoints, &dir.path().join("accounting.log"))]);
    eventually("the accounting service never started", || {
        pg.try_query("SELECT count(*) FROM ingest_cursor").is_ok_and(|n| n.trim() == "1")
    });
    let submit = |args: &[&str]| submit_parsable(&endpoints, args, &work);
    let state_of = |id: u64| -> String {
        let shown = stdout(&cli(&endpoints, &["show", &id.to_string(), "--json"], &work));
        shown.split("\"state\": \"").nth(1).and_then(|s| s.split('"').next()).unwrap_or("").to_string()
    };
    let stored = |ids: &[u64]| -> String {
        let ids = ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        pg.query(&format!("SELECT job_id, state FROM jobs WHERE job_id IN ({ids}) ORDER BY job_id"))
    };
    let service_log = || std::fs::read_to_string(dir.path().join("accounting.log")).unwrap_or_default();
    let all_stored = |ids: &[u64], state: &str| {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        let want: String = sorted.iter().map(|j| format!("{j}|{state}\n")).collect();
        let deadline = Instant::now() + WAIT;
        while stored(ids) != want {
            let log = service_log();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            assert!(Instant::now() < deadline, "jobs {ids:?} never all stored {state}: {}\n{tail:#?}", stored(ids));
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    // Before the backup: jobs that ran, and one still held when it is taken.
    let before: Vec<u64> = (0..3).map(|_| submit(&["--", "true"])).collect();
    let held = submit(&["-H", "--", "true"]);
    all_stored(&before, "COMPLETED");
    let file = dir.path().join("gangway.backup");
    let o = cli(&endpoints, &["cluster", "backup", file.to_str().unwrap()], &work);
    assert!(o.status.success(), "backup: {}", String::from_utf8_lossy(&o.stderr));
    // After it, more entries than the new cluster will write before its
    // own jobs: the service's cursor ends well past the backup's index.
    let after: Vec<u64> = (0..8).map(|_| submit(&["--", "true"])).collect();
    all_stored(&after, "COMPLETED");
    let cursor = || pg.query("SELECT log_index FROM ingest_cursor").trim().parse::<u64>().unwrap();
    let old_cursor = cursor();
    // Every replica is lost; a new cluster is restored from the backup on
    // the same addresses, while the service keeps running.
    drop(controllers);
    controllers = start("restored", Some(&file));
    eventually("the restored cluster never answered", || cli(&endpoints, &["nodes"], &work).status.success());
    let o = cli(&endpoints, &["release", &held.to_string()], &work);
    assert!(o.status.success(), "release: {}", String::from_utf8_lossy(&o.stderr));
    let new: Vec<u64> = (0..2).map(|_| submit(&["--", "true"])).collect();
    assert!(new.iter().all(|j| *j > held + 1_000_000), "job ids jump past the lost cluster's: {new:?}");
    eventually("the new jobs never finished", || new.iter().chain([&held]).all(|j| state_of(*j) == "COMPLETED"));
    // The held job ran in the new history, after the backup: stored as it ended there.
    let mut restored_jobs = new.clone();
    restored_jobs.push(held);
    all_stored(&restored_jobs, "COMPLETED");
    // The service followed the new history, which starts below its old cursor.
    assert!(service_log().contains("history changed"), "{}", service_log());
    let history = pg.query("SELECT history FROM ingest_cursor");
    assert_ne!(history.trim(), "0", "the cursor names the new history");
    // The one the restored cluster's leader drew, as every replica has it
    // (not the one derived from the backup, which the service never saw).
    let status: serde_json::Value =
        serde_json::from_str(&stdout(&cli(&endpoints, &["cluster", "status", "--json"], &work))).unwrap();
    // (The store keeps a u64 history in a BIGINT, bit for bit.)
    let cursor_history = u64::from_ne_bytes(history.trim().parse::<i64>().unwrap().to_ne_bytes());
    for r in status["replicas"].as_array().unwrap() {
        assert_eq!(
            r["history"].as_u64(),
            Some(cursor_history),
            "the cursor's history is not replica {}'s: {r}",
            r["id"]
        );
        assert_eq!(r["history_pending"], false, "{r}");
    }
    // Their events too: the new history's, from its first entry on.
    let new_ids = restored_jobs.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let finished_in_new = || {
        pg.query(&format!(
            "SELECT count(*) FROM events WHERE history = {} AND kind = 'finished' AND job_id IN ({new_ids})",
            history.trim()
        ))
    };
    let events = || pg.query("SELECT history, log_index, kind, job_id FROM events ORDER BY history, log_index");
    let deadline = Instant::now() + WAIT;
    while finished_in_new().trim() != restored_jobs.len().to_string() {
        assert!(
            Instant::now() < deadline,
            "the new history's events were never stored:\n{}\n{}",
            events(),
            service_log()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let lowest = pg.query(&format!(
        "SELECT min(log_index) FROM events WHERE history = {} AND job_id IN ({new_ids})",
        history.trim()
    ));
    let lowest: u64 = lowest.trim().parse().unwrap();
    assert!(lowest < old_cursor, "the new history's events reach below the old cursor {old_cursor}:\n{}", events());
    // Every job once, each with its `finished` event once in its history.
    let everyone: Vec<u64> = before.iter().chain(&after).chain(&restored_jobs).copied().collect();
    let ids = everyone.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    assert_eq!(
        pg.query(&format!("SELECT count(*) FROM jobs WHERE job_id IN ({ids})")).trim(),
        everyone.len().to_string()
    );
    let per_job = pg.query(&format!(
        "SELECT job_id, sum((kind = 'finished')::int) FROM events WHERE job_id IN ({ids}) GROUP BY job_id ORDER BY job_id"
    ));
    let mut sorted = everyone.clone();
    sorted.sort_unstable();
    let want: String = sorted.iter().map(|j| format!("{j}|1\n")).collect();
    assert_eq!(per_job, want, "finished events per job");
    // The jobs run after the backup are not in the restored state, and are
    // still found: in the accounting store.
    let shown = stdout(&cli(&endpoints, &["show", &after[0].to_string(), "--json"], &work));
    assert!(shown.contains("\"source\": \"accounting\""), "{shown}");
    // An operator's way out when the service is gone for good: every job
    // finished so far counts as stored (no database needed).
    let o = cli(&endpoints, &["accounting", "release-unstored"], &work);
    assert!(stdout(&o).contains("treats every job finished through log index"), "{o:?}");
    drop(controllers);
}

/// Three replicas' loopback addresses: (addresses, `--peers`, endpoints).
fn three_replicas() -> (Vec<String>, String, String) {
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let peers: Vec<String> = addrs.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect();
    let (peers, endpoints) = (peers.join(","), addrs.join(","));
    (addrs, peers, endpoints)
}

/// `gangway submit --parsable ARGS` as root: the new job's id.
fn submit_parsable(endpoints: &str, args: &[&str], work: &Path) -> u64 {
    let mut all = vec!["submit", "--parsable"];
    all.extend_from_slice(args);
    let o = cli(endpoints, &all, work);
    assert!(o.status.success(), "submit {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    stdout(&o).trim().parse().unwrap()
}

/// `gangway accounting` into `url`, as root, its log appended to `log`.
fn accounting_service(url: &str, endpoints: &str, log: &Path) -> Child {
    let log = std::fs::File::options().create(true).append(true).open(log).unwrap();
    // Its own narrow identity (`--accounting-identity` on the controllers),
    // not an operator's: it reads every job and reports what it stored.
    as_user(Command::new(GANGWAY).args(["accounting", "--database", url]), "accounting")
        .env("GANGWAY_ENDPOINTS", endpoints)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

fn serde_leader(status: &str) -> usize {
    let v: serde_json::Value = serde_json::from_str(status).unwrap();
    v["leader_id"].as_u64().or_else(|| v["leader"].as_u64()).unwrap_or_else(|| panic!("no leader in {status}")) as usize
}
