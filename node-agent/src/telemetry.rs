//! The agent's Prometheus metrics: the node (registered, time since a leader
//! answered, tasks running) and every GPU (health, and with NVML utilization,
//! memory, temperature and power), labelled with the job using the GPU. Read
//! when scraped from what the agent loop last saw.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use gangway_proto::telemetry::{self, Gauges};
use gangway_proto::v1::{GpuHealthReport, GpuInventory};

use crate::nvml::NvmlProvider;

/// What the agent loop last saw.
#[derive(Default)]
pub struct View {
    pub registered: bool,
    pub last_contact: Option<Instant>,
    pub tasks_running: usize,
    /// GPU index → the job whose task holds it.
    pub gpu_jobs: BTreeMap<u32, u64>,
    pub health: Vec<GpuHealthReport>,
}

/// `cert_not_after`: when the agent's TLS certificate expires (Unix seconds).
pub fn render(
    node: &str,
    gpus: &[GpuInventory],
    view: &View,
    nvml: Option<&NvmlProvider>,
    cert_not_after: Option<i64>,
) -> String {
    let mut g = Gauges::default();
    let n = [("node", node)];
    if let Some(not_after) = cert_not_after {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        g.set(
            "gangway_tls_cert_expiry_seconds",
            "Seconds until this agent's TLS certificate expires (negative: expired).",
            &n,
            not_after.saturating_sub(now) as f64,
        );
    }
    g.set(
        "gangway_agent_registered",
        "1 when the node is registered with the leader.",
        &n,
        f64::from(u8::from(view.registered)),
    );
    if let Some(t) = view.last_contact {
        g.set(
            "gangway_agent_seconds_since_contact",
            "Seconds since a leader last answered this agent's heartbeat.",
            &n,
            t.elapsed().as_secs_f64(),
        );
    }
    g.set("gangway_agent_tasks_running", "Job tasks running on this node.", &n, view.tasks_running as f64);
    for (index, inv) in (0..=u32::MAX).zip(gpus) {
        let idx = index.to_string();
        let job = view.gpu_jobs.get(&index).map(u64::to_string).unwrap_or_default();
        // `job_id`, not `job`: Prometheus gives every target a `job` label of its own.
        let l = [
            ("node", node),
            ("gpu", idx.as_str()),
            ("uuid", inv.uuid.as_str()),
            ("model", inv.model.as_str()),
            ("job_id", job.as_str()),
        ];
        let healthy = view.health.iter().find(|h| h.index == index).is_none_or(|h| h.healthy);
        g.set("gangway_gpu_healthy", "1 when the GPU passes its health checks.", &l, f64::from(u8::from(healthy)));
        g.set("gangway_gpu_allocated", "1 when a job's task holds the GPU.", &l, f64::from(u8::from(!job.is_empty())));
        g.set("gangway_gpu_memory_total_bytes", "The GPU's memory.", &l, inv.mem_mb.saturating_mul(1024 * 1024) as f64);
        if let Some(r) = nvml.and_then(|p| p.readings(index)) {
            g.set("gangway_gpu_utilization_ratio", "Fraction of time a kernel ran (NVML).", &l, r.utilization);
            g.set("gangway_gpu_memory_used_bytes", "GPU memory in use (NVML).", &l, r.memory_used_bytes);
            g.set("gangway_gpu_temperature_celsius", "GPU die temperature (NVML).", &l, r.temperature_celsius);
            g.set("gangway_gpu_power_watts", "GPU power draw (NVML).", &l, r.power_watts);
        }
    }
    g.finish()
}

/// Serves the agent's metrics until the returned task is aborted.
pub fn serve(
    listener: tokio::net::TcpListener,
    node: String,
    gpus: Vec<GpuInventory>,
    view: Arc<Mutex<View>>,
    nvml: Option<Arc<NvmlProvider>>,
    tls: Option<Arc<gangway_proto::tls::Credentials>>,
    metrics_tls: Option<telemetry::MetricsTls>,
) -> tokio::task::JoinHandle<()> {
    telemetry::recorder();
    let render = Arc::new(move || {
        let v = view.lock().expect("view lock");
        render(&node, &gpus, &v, nvml.as_deref(), tls.as_ref().and_then(|c| c.not_after()))
    });
    tokio::spawn(telemetry::serve(listener, render, metrics_tls))
}
