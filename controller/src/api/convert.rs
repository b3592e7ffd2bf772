//! Protobuf ⇄ core conversion. Protobuf types stop here: the core never sees them.

use gangway_core::spec::{parse_dependencies, Dependency, GpuSpec, HetComponent, TopologyConstraint};
use gangway_core::{Job, JobSpec, JobState, Node, NodeSpec, NodeState, SpecError};
use gangway_proto::v1 as pb;

fn opt_u32(field: &str, v: Option<i64>, default: u32, min: i64) -> Result<u32, SpecError> {
    match v {
        None => Ok(default),
        Some(x) if x < min => Err(SpecError::new(field, format!("must be at least {min}, got {x}"))),
        Some(x) => u32::try_from(x).map_err(|_| SpecError::new(field, format!("{x} is too large"))),
    }
}

fn opt_u64(field: &str, v: Option<i64>, default: u64, min: i64) -> Result<u64, SpecError> {
    match v {
        None => Ok(default),
        Some(x) if x < min => Err(SpecError::new(field, format!("must be at least {min}, got {x}"))),
        Some(x) => Ok(x as u64),
    }
}

/// Builds and validates a core spec; unset fields get their defaults.
pub fn spec_from_proto(p: pb::JobSpec, default_user: &str) -> Result<JobSpec, SpecError> {
    let d = JobSpec::default();
    let (dependencies, singleton) = parse_dependencies(&p.dependency)?;
    if p.components.len() > gangway_core::limits::HET_COMPONENTS_MAX {
        return Err(SpecError::new(
            "components",
            format!(
                "a heterogeneous job has at most {} components",
                gangway_core::limits::HET_COMPONENTS_MAX.saturating_add(1)
            ),
        ));
    }
    let components = p
        .components
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            component_from_proto(c)
                .map_err(|e| SpecError::new(&format!("components[{}].{}", i.saturating_add(1), e.field), e.rule))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let spec = JobSpec {
        name: p.name,
        user: if p.user.is_empty() { default_user.to_string() } else { p.user },
        command: p.command,
        script: p.script.into(),
        workdir: p.workdir,
        partition: p.partition,
        nodes: opt_u32("nodes", p.nodes, d.nodes, 1)?,
        tasks_per_node: opt_u32("tasks_per_node", p.tasks_per_node, d.tasks_per_node, 1)?,
        cpus_per_task: opt_u32("cpus_per_task", p.cpus_per_task, d.cpus_per_task, 1)?,
        mem_per_node_mb: opt_u64("mem_per_node_mb", p.mem_per_node_mb, d.mem_per_node_mb, 0)?,
        gpus_per_node: opt_u32("gpus_per_node", p.gpus_per_node, d.gpus_per_node, 0)?,
        gpu_type: p.gpu_type,
        time_limit_s: opt_u64("time_limit_s", p.time_limit_s, d.time_limit_s, 0)?,
        env: p.env.into_iter().collect(),
        requeue: p.requeue.unwrap_or(d.requeue),
        output: p.output,
        error: p.error,
        warn_signal: u8::try_from(p.warn_signal)
            .map_err(|_| SpecError::new("warn_signal", format!("{} is not a signal number (1-31)", p.warn_signal)))?,
        warn_before_s: p.warn_before_s,
        warn_batch_shell: p.warn_batch_shell,
        account: p.account,
        qos: p.qos,
        nodes_max: p.nodes_max,
        mem_per_cpu_mb: p.mem_per_cpu_mb,
        constraints: p.constraints,
        exclusive: p.exclusive,
        topology: p
            .topology
            .map(|t| TopologyConstraint { level: t.level, required: t.required, wait_s: t.wait_s })
            .unwrap_or_default(),
        dependencies,
        singleton,
        kill_on_invalid_dep: p.kill_on_invalid_dep.unwrap_or(d.kill_on_invalid_dep),
        begin_ms: p.begin_time_ms,
        comment: p.comment,
        batch: p.batch,
        truncate_output: p.truncate_output,
        nodelist: p.nodelist,
        exclude: p.exclude,
        array: p.array,
        nice: p.nice,
        hold: p.hold,
        licenses: p.licenses.into_iter().collect(),
        reservation: p.reservation,
        time_min_s: p.time_min_s,
        deadline_ms: p.deadline_ms,
        requeue_expedite: p.requeue_expedite,
        components,
    };
    spec.validate()?;
    spec.check_printable()?;
    gangway_core::limits::check_spec_size(&spec)?;
    Ok(spec)
}

pub fn spec_to_proto(s: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        name: s.name.clone(),
        user: s.user.clone(),
        command: s.command.clone(),
        script: s.script.to_string(),
        workdir: s.workdir.clone(),
        partition: s.partition.clone(),
        nodes: Some(s.nodes.into()),
        tasks_per_node: Some(s.tasks_per_node.into()),
        cpus_per_task: Some(s.cpus_per_task.into()),
        mem_per_node_mb: Some(s.mem_per_node_mb as i64),
        gpus_per_node: Some(s.gpus_per_node.into()),
        gpu_type: s.gpu_type.clone(),
        time_limit_s: Some(s.time_limit_s as i64),
        env: s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        requeue: Some(s.requeue),
        output: s.output.clone(),
        error: s.error.clone(),
        warn_signal: s.warn_signal.into(),
        warn_before_s: s.warn_before_s,
        warn_batch_shell: s.warn_batch_shell,
        account: s.account.clone(),
        qos: s.qos.clone(),
        nodes_max: s.nodes_max,
        mem_per_cpu_mb: s.mem_per_cpu_mb,
        constraints: s.constraints.clone(),
        exclusive: s.exclusive,
        topology: (!s.topology.level.is_empty()).then(|| pb::TopologyConstraint {
            level: s.topology.level.clone(),
            required: s.topology.required,
            wait_s: s.topology.wait_s,
        }),
        dependency: format_dependencies(&s.dependencies, s.singleton),
        array: s.array.clone(),
        nice: s.nice,
        hold: s.hold,
        kill_on_invalid_dep: Some(s.kill_on_invalid_dep),
        begin_time_ms: s.begin_ms,
        comment: s.comment.clone(),
        batch: s.batch,
        truncate_output: s.truncate_output,
        nodelist: s.nodelist.clone(),
        exclude: s.exclude.clone(),
        licenses: s.licenses.clone().into_iter().collect(),
        reservation: s.reservation.clone(),
        time_min_s: s.time_min_s,
        deadline_ms: s.deadline_ms,
        requeue_expedite: s.requeue_expedite,
        components: s.components.iter().map(component_to_proto).collect(),
        // A request option, never stored.
        force_reservation: false,
    }
}

/// One further component of a heterogeneous job; unset fields get the
/// defaults a job's own fields get.
fn component_from_proto(c: pb::JobComponent) -> Result<HetComponent, SpecError> {
    let d = HetComponent::default();
    Ok(HetComponent {
        partition: c.partition,
        nodes: opt_u32("nodes", c.nodes, d.nodes, 1)?,
        tasks_per_node: opt_u32("tasks_per_node", c.tasks_per_node, d.tasks_per_node, 1)?,
        cpus_per_task: opt_u32("cpus_per_task", c.cpus_per_task, d.cpus_per_task, 1)?,
        mem_per_node_mb: opt_u64("mem_per_node_mb", c.mem_per_node_mb, d.mem_per_node_mb, 0)?,
        mem_per_cpu_mb: c.mem_per_cpu_mb,
        gpus_per_node: opt_u32("gpus_per_node", c.gpus_per_node, d.gpus_per_node, 0)?,
        gpu_type: c.gpu_type,
        constraints: c.constraints,
        exclusive: c.exclusive,
        nodelist: c.nodelist,
        exclude: c.exclude,
    })
}

fn component_to_proto(c: &HetComponent) -> pb::JobComponent {
    pb::JobComponent {
        partition: c.partition.clone(),
        nodes: Some(c.nodes.into()),
        tasks_per_node: Some(c.tasks_per_node.into()),
        cpus_per_task: Some(c.cpus_per_task.into()),
        mem_per_node_mb: Some(c.mem_per_node_mb as i64),
        mem_per_cpu_mb: c.mem_per_cpu_mb,
        gpus_per_node: Some(c.gpus_per_node.into()),
        gpu_type: c.gpu_type.clone(),
        constraints: c.constraints.clone(),
        exclusive: c.exclusive,
        nodelist: c.nodelist.clone(),
        exclude: c.exclude.clone(),
    }
}

/// Slurm's `--dependency` syntax for a spec's list of dependencies, as the
/// user wrote them: an array element is `ARRAY_INDEX`, so it parses back to
/// the same list.
pub fn format_dependencies(deps: &[Dependency], singleton: bool) -> String {
    let mut parts: Vec<String> = deps
        .iter()
        .map(|d| match d.array_index {
            Some(i) => format!("{}:{}_{i}", d.kind.as_str(), d.job_id),
            None => format_dependency(d),
        })
        .collect();
    if singleton {
        parts.push("singleton".into());
    }
    parts.join(",")
}

/// Resolved dependencies name concrete job ids (an array element's own id).
fn format_dependency(d: &Dependency) -> String {
    format!("{}:{}", d.kind.as_str(), d.job_id)
}

pub fn state_to_proto(s: JobState) -> pb::JobState {
    match s {
        JobState::Pending => pb::JobState::Pending,
        JobState::Running => pb::JobState::Running,
        JobState::Completed => pb::JobState::Completed,
        JobState::Failed => pb::JobState::Failed,
        JobState::Cancelled => pb::JobState::Cancelled,
        JobState::TimedOut => pb::JobState::Timeout,
        JobState::NodeFail => pb::JobState::NodeFail,
        JobState::Deadline => pb::JobState::Deadline,
    }
}

pub fn state_from_proto(s: pb::JobState) -> Option<JobState> {
    Some(match s {
        pb::JobState::Unspecified => return None,
        pb::JobState::Pending => JobState::Pending,
        pb::JobState::Running => JobState::Running,
        pb::JobState::Completed => JobState::Completed,
        pb::JobState::Failed => JobState::Failed,
        pb::JobState::Cancelled => JobState::Cancelled,
        pb::JobState::Timeout => JobState::TimedOut,
        pb::JobState::NodeFail => JobState::NodeFail,
        pb::JobState::Deadline => JobState::Deadline,
        // Suspended is a running job's display state.
        pb::JobState::Suspended => JobState::Running,
    })
}

/// The state a job shows: a suspended running job is SUSPENDED.
pub fn job_state_to_proto(j: &Job) -> pb::JobState {
    if j.state == JobState::Running && j.is_suspended() {
        pb::JobState::Suspended
    } else {
        state_to_proto(j.state)
    }
}

/// A task's measured use from its agent's report, or why it is impossible.
pub fn task_usage_from_proto(u: &pb::TaskUsage) -> Result<gangway_core::model::TaskUsage, String> {
    let usage = gangway_core::model::TaskUsage {
        cpu_ms: u.cpu_ms,
        mem_peak_mb: u.mem_peak_mb,
        gpu_samples: u.gpu_samples,
        gpu_util_pct_sum: u.gpu_util_pct_sum,
        gpu_mem_peak_mb: u.gpu_mem_peak_mb,
    };
    usage.check()?;
    Ok(usage)
}

pub fn job_to_proto(j: &Job) -> pb::Job {
    pb::Job {
        id: j.id,
        spec: Some(spec_to_proto(&j.spec)),
        state: job_state_to_proto(j) as i32,
        attempt: j.attempt,
        submitted_by: j.submitted_by.clone(),
        submit_time_ms: j.submit_time_ms,
        start_time_ms: j.start_time_ms,
        end_time_ms: j.end_time_ms,
        allocation: j
            .allocation
            .iter()
            .flat_map(|a| a.nodes.iter())
            .map(|na| pb::NodeAllocation {
                node: na.node.clone(),
                cpus: na.cpus,
                mem_mb: na.mem_mb,
                gpus: na.gpus.clone(),
            })
            .collect(),
        exit_code: j.exit_code,
        reason: j.reason.clone(),
        ran_on: j.ran_on.clone(),
        array_job_id: j.array.map(|a| a.array_job_id),
        array_index: j.array.map(|a| a.index),
        pending_dependencies: j.deps_pending.iter().map(format_dependency).collect(),
        held: j.held.map(|h| h.as_str().to_string()).unwrap_or_default(),
        priority_override: j.priority_override,
        preempted: j.preempted,
        last_checkpoint_ms: j.last_checkpoint_ms,
        display_id: j.display_id(),
        exit_signal: j.task_exits.values().find_map(|t| t.signal),
        suspended_at_ms: j.suspended_at_ms,
        suspended_ms: j.suspended_ms,
        steps: j
            .steps
            .iter()
            .map(|s| pb::JobStep {
                id: s.id,
                name: s.name.clone(),
                nodes: s.nodes.clone(),
                tasks: s.tasks,
                start_ms: s.start_ms,
                end_ms: s.end_ms,
                state: state_to_proto(s.state) as i32,
                exit_code: s.exit_code,
                signal: s.signal,
            })
            .collect(),
        usage: j.usage().map(|u| pb::JobUsage {
            nodes: u.nodes,
            cpu_ms: u.cpu_ms,
            mem_peak_mb: u.mem_peak_mb,
            gpu_util_pct: u.gpu_util_pct,
            gpu_mem_peak_mb: u.gpu_mem_peak_mb,
        }),
    }
}

pub fn node_to_proto(
    n: &Node,
    last_heartbeat_age_ms: Option<u64>,
    reservation: Option<&gangway_core::reservation::Reservation>,
) -> pb::Node {
    pb::Node {
        name: n.name.clone(),
        addr: n.addr.clone(),
        cpus: n.cpus,
        mem_mb: n.mem_mb,
        gpus: n
            .gpus
            .iter()
            .map(|g| pb::Gpu {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                mem_mb: g.mem_mb,
                nvlink_island: g.nvlink_island,
                healthy: g.health == gangway_core::GpuHealth::Healthy,
                allocated_to: g.allocated_to,
                allocated: g.allocated_to.is_some(),
                health_reason: g.health_reason.clone(),
            })
            .collect(),
        topology: n.topology.clone(),
        labels: n.labels.clone().into_iter().collect(),
        state: match n.state {
            NodeState::Up => pb::NodeState::Up,
            NodeState::Drain => pb::NodeState::Drain,
            NodeState::Down => pb::NodeState::Down,
            NodeState::PoweredDown => pb::NodeState::PoweredDown,
            NodeState::PoweringUp => pb::NodeState::PoweringUp,
        } as i32,
        state_reason: n.state_reason.clone(),
        cpus_alloc: n.cpus_alloc,
        mem_alloc_mb: n.mem_alloc_mb,
        jobs: n.jobs.clone(),
        last_heartbeat_age_ms,
        reservation: reservation.map(|r| r.name.clone()).unwrap_or_default(),
        maint: reservation.is_some_and(|r| r.flags.maint),
    }
}

/// A heartbeat as the core reads it (`duties::on_heartbeat`).
pub fn node_spec_from_proto(r: pb::RegisterRequest) -> Result<NodeSpec, SpecError> {
    let spec = NodeSpec {
        name: r.name,
        addr: r.addr,
        cpus: r.cpus,
        mem_mb: r.mem_mb,
        gpus: r
            .gpus
            .into_iter()
            .map(|g| GpuSpec { uuid: g.uuid, model: g.model, mem_mb: g.mem_mb, nvlink_island: g.nvlink_island })
            .collect(),
        topology: r.topology,
        labels: r.labels.into_iter().collect(),
    };
    spec.validate()?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_and_zero_resources_name_the_field() {
        let base = pb::JobSpec { command: vec!["true".into()], ..Default::default() };
        let cases = [
            (pb::JobSpec { nodes: Some(-1), ..base.clone() }, "nodes"),
            (pb::JobSpec { nodes: Some(0), ..base.clone() }, "nodes"),
            (pb::JobSpec { cpus_per_task: Some(0), ..base.clone() }, "cpus_per_task"),
            (pb::JobSpec { gpus_per_node: Some(-2), ..base.clone() }, "gpus_per_node"),
            (pb::JobSpec { time_limit_s: Some(-5), ..base.clone() }, "time_limit_s"),
            (pb::JobSpec { nodes: Some(i64::MAX), ..base.clone() }, "nodes"),
        ];
        for (p, field) in cases {
            assert_eq!(spec_from_proto(p, "alice").unwrap_err().field, field);
        }
        let ok = spec_from_proto(base, "alice").unwrap();
        assert_eq!((ok.nodes, ok.user.as_str()), (1, "alice"));
    }

    /// Found by the proto_spec fuzz target: an array element's dependency
    /// lost its index on the way back to protobuf.
    #[test]
    fn a_spec_survives_the_trip_through_protobuf() {
        let p = pb::JobSpec {
            command: vec!["true".into()],
            dependency: "afterok:68_48,afterany:7,singleton".into(),
            batch: true,
            components: vec![pb::JobComponent { partition: "cpu".into(), nodes: Some(2), ..Default::default() }],
            ..Default::default()
        };
        let spec = spec_from_proto(p, "alice").unwrap();
        assert_eq!(spec.dependencies[0].array_index, Some(48));
        assert_eq!((spec.components[0].nodes, spec.components[0].cpus_per_task), (2, 1));
        let back = spec_to_proto(&spec);
        assert_eq!(back.dependency, "afterok:68_48,afterany:7,singleton");
        assert_eq!(spec_from_proto(back, "alice").unwrap(), spec);
    }
}
