//! Router-native flow, decode side: registers a decode's receiver with
//! the prefill ranks that parked a request's KV ([`LoadQueue::register`]),
//! on background threads, and keeps each registration's outcome for
//! [`LoadQueue::poll_registrations`].

use crate::backend::register::register;
use crate::backend::{lock, BackendError};
use crate::config::PdConfig;
use crate::protocol::RegisterDecode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Threads sending registrations (one slow prefill holds up one of them).
const THREADS: usize = 2;

/// Registering sockets started by this process (part of their names).
static ROUTES: AtomicU64 = AtomicU64::new(0);

/// How long one prefill rank may take to answer a registration.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

struct Job {
    req_id: String,
    /// `tcp://host:port` of every prefill rank.
    urls: Vec<String>,
    msg: RegisterDecode,
}

/// Registrations that ended: the request id and how.
type Outcomes = Arc<Mutex<Vec<(String, Result<(), String>)>>>;

/// The registration threads of a load queue.
pub(super) struct Registrar {
    tx: Mutex<Option<crossbeam_channel::Sender<Job>>>,
    done: Outcomes,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// This decode's receiver, as registrations name it.
    host: String,
    init_ports: Vec<u64>,
    alloc_ports: Vec<u64>,
}

impl Registrar {
    pub(super) fn start(config: &PdConfig) -> Result<Registrar, BackendError> {
        let (secret, host) = crate::backend::register::secret_and_host(config)?;
        let ranks = config.tp_size.max(1);
        let init_ports: Vec<u64> = (0..ranks)
            .filter_map(|r| config.init_port(r).map(u64::from))
            .collect();
        let alloc_ports: Vec<u64> = (0..ranks)
            .filter_map(|r| config.alloc_port(r).map(u64::from))
            .collect();
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let done: Outcomes = Arc::new(Mutex::new(Vec::new()));
        let ctx = zmq::Context::new();
        let tag = crate::auth::hex(&crate::auth::nonce()[..8]);
        let mut threads = Vec::new();
        for i in 0..THREADS {
            let (rx, done, ctx, secret, tag) = (
                rx.clone(),
                Arc::clone(&done),
                ctx.clone(),
                secret.clone(),
                tag.clone(),
            );
            threads.push(crate::backend::spawn(
                &format!("apd-registrar-{i}"),
                move || {
                    for job in rx {
                        let mut r = Ok(());
                        for url in &job.urls {
                            // A name no other registering socket has (the
                            // prefill's ROUTER drops a second connection
                            // under a name in use): random per registrar,
                            // counted per process.
                            let route =
                                format!("reg-{tag}-{}", ROUTES.fetch_add(1, Ordering::Relaxed));
                            if let Err(e) = register(
                                &ctx,
                                secret.as_ref(),
                                url,
                                &job.msg,
                                &route,
                                ANSWER_TIMEOUT,
                            ) {
                                r = Err(e);
                                break;
                            }
                        }
                        match &r {
                            Ok(()) => log::debug!(
                                "request {:?}: registered for transfer {:?} with {:?}",
                                job.req_id,
                                job.msg.transfer_id,
                                job.urls
                            ),
                            Err(e) => log::warn!(
                                "request {:?}: registering for transfer {:?}: {e}",
                                job.req_id,
                                job.msg.transfer_id
                            ),
                        }
                        lock(&done).push((job.req_id, r));
                    }
                },
            )?);
        }
        Ok(Registrar {
            tx: Mutex::new(Some(tx)),
            done,
            threads: Mutex::new(threads),
            host,
            init_ports,
            alloc_ports,
        })
    }

    pub(super) fn register(
        &self,
        req_id: &str,
        prefill_host: &str,
        prefill_ports: &[u16],
        transfer_id: &str,
        held_tokens: u64,
    ) -> Result<(), BackendError> {
        if prefill_host.is_empty() || prefill_ports.is_empty() || prefill_ports.contains(&0) {
            return Err(BackendError::InvalidInput(format!(
                "request {req_id:?}: the prefill's registration address is {prefill_host:?} \
                 {prefill_ports:?}; it needs a host and one port (1-65535) per prefill rank"
            )));
        }
        if self.init_ports.is_empty() || self.init_ports.len() != self.alloc_ports.len() {
            return Err(BackendError::InvalidInput(
                "this receiver has no pd_peer_init_port / pd_peer_alloc_port per TP rank to \
                 register with the prefill: set them in its YAML"
                    .into(),
            ));
        }
        let job = Job {
            req_id: req_id.to_string(),
            urls: prefill_ports
                .iter()
                .map(|p| format!("tcp://{prefill_host}:{p}"))
                .collect(),
            msg: RegisterDecode {
                transfer_id: transfer_id.to_string(),
                receiver_host: self.host.clone(),
                receiver_init_port: self.init_ports.clone(),
                receiver_alloc_port: self.alloc_ports.clone(),
                held_tokens,
            },
        };
        match &*lock(&self.tx) {
            Some(tx) => tx.send(job).map_err(|_| BackendError::Closed),
            None => Err(BackendError::Closed),
        }
    }

    pub(super) fn poll(&self) -> Vec<(String, Result<(), String>)> {
        std::mem::take(&mut *lock(&self.done))
    }

    pub(super) fn shutdown(&self) {
        lock(&self.tx).take();
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}
