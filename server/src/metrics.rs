//! Prometheus metrics, served as text at `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    /// The matched route pattern, never the raw path: ids would make the
    /// label set grow without bound.
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    /// The `Limits` setting that refused the work; a fixed set of names.
    pub limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// A request pool (`request_slots::Pool::label`); a fixed set of names.
    pub pool: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    /// A running job's id: the set is as large as the running private jobs.
    pub job_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

type HistogramMaker = fn() -> Histogram;

pub struct Metrics {
    registry: Registry,
    pub request_seconds: Family<RequestLabels, Histogram, HistogramMaker>,
    pub rounds: Family<OutcomeLabels, Counter>,
    pub updates_accepted: Counter,
    pub bytes_received: Counter,
    pub bytes_sent: Counter,
    pub online_devices: Gauge,
    pub open_connections: Gauge,
    pub refusals: Family<LimitLabels, Counter>,
    /// Places taken in each request pool, set when `/metrics` is read.
    pub request_slots_in_use: Family<PoolLabels, Gauge>,
    /// The ε each running differentially private job has spent, set when
    /// `/metrics` is read.
    pub privacy_epsilon: Family<JobLabels, Gauge<f64, AtomicU64>>,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("canopy");
        let request_seconds: Family<RequestLabels, Histogram, HistogramMaker> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "http_request_duration_seconds",
            "Time to the response head, by route and status",
            request_seconds.clone(),
        );
        let rounds = Family::<OutcomeLabels, Counter>::default();
        registry.register("rounds", "Rounds finished, by outcome", rounds.clone());
        let updates_accepted = Counter::default();
        registry.register(
            "updates_accepted",
            "Device updates folded into a round",
            updates_accepted.clone(),
        );
        let bytes_received = Counter::default();
        registry.register(
            "update_bytes_received",
            "Bytes of accepted device updates",
            bytes_received.clone(),
        );
        let bytes_sent = Counter::default();
        registry.register(
            "model_bytes_sent",
            "Bytes of model files sent to devices and admins",
            bytes_sent.clone(),
        );
        let online_devices = Gauge::default();
        registry.register(
            "online_devices",
            "Unrevoked devices seen within the online window",
            online_devices.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "open_connections",
            "Client connections admitted and not yet closed",
            open_connections.clone(),
        );
        let refusals = Family::<LimitLabels, Counter>::default();
        registry.register(
            "limit_refusals",
            "Connections and requests refused at a limit, by the limit's setting",
            refusals.clone(),
        );
        let request_slots_in_use = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "request_slots_in_use",
            "Places taken in each request pool (task_polls: polls waiting)",
            request_slots_in_use.clone(),
        );
        let privacy_epsilon = Family::<JobLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "job_privacy_epsilon",
            "Epsilon spent by each running differentially private job, at its delta",
            privacy_epsilon.clone(),
        );
        Metrics {
            registry,
            privacy_epsilon,
            request_slots_in_use,
            open_connections,
            refusals,
            request_seconds,
            rounds,
            updates_accepted,
            bytes_received,
            bytes_sent,
            online_devices,
        }
    }

    pub fn round_finished(&self, outcome: &str) {
        self.rounds
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts a connection or request refused at `limit`.
    pub fn refused(&self, limit: &'static str) {
        self.refusals.get_or_create(&LimitLabels { limit }).inc();
    }

    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}
