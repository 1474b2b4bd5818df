//! The handle registry: every object the C ABI hands out is an id here, so
//! a closed, unknown or mistyped handle is an error, never a dangling
//! pointer.

use super::{Failure, APD_ERR_CLOSED};
use crate::backend::lock;
use crate::config::PdConfig;
use crate::requests::{Completion, LoadQueue, SaveQueue, SharedKvCache};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// A sender with its save queue and the completions not yet polled.
pub(crate) struct SenderObj {
    pub(crate) queue: SaveQueue,
    pub(crate) backlog: Mutex<VecDeque<Completion>>,
    /// Ids of saves no longer reading the cache, not yet polled.
    pub(crate) released_backlog: Mutex<VecDeque<String>>,
}

impl SenderObj {
    pub(crate) fn new(queue: SaveQueue) -> SenderObj {
        SenderObj {
            queue,
            backlog: Mutex::new(VecDeque::new()),
            released_backlog: Mutex::new(VecDeque::new()),
        }
    }
}

/// A receiver with its load queue and the completions not yet polled.
pub(crate) struct ReceiverObj {
    pub(crate) queue: LoadQueue,
    pub(crate) backlog: Mutex<VecDeque<Completion>>,
    /// Registration outcomes not yet polled.
    pub(crate) registered_backlog: Mutex<VecDeque<Completion>>,
}

impl ReceiverObj {
    pub(crate) fn new(queue: LoadQueue) -> ReceiverObj {
        ReceiverObj {
            queue,
            backlog: Mutex::new(VecDeque::new()),
            registered_backlog: Mutex::new(VecDeque::new()),
        }
    }
}

pub(crate) enum Object {
    Config(Arc<PdConfig>),
    Cache(Arc<SharedKvCache>),
    Sender(Arc<SenderObj>),
    Receiver(Arc<ReceiverObj>),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Config(_) => "ApdConfig",
            Object::Cache(_) => "ApdKvCache",
            Object::Sender(_) => "ApdSender",
            Object::Receiver(_) => "ApdReceiver",
        }
    }
}

struct Registry {
    next: u64,
    objects: HashMap<u64, Object>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut g = lock(&REGISTRY);
    let r = g.get_or_insert_with(|| Registry {
        next: 1,
        objects: HashMap::new(),
    });
    f(r)
}

/// Stores `o`; returns its handle id (never 0).
pub(crate) fn insert(o: Object) -> u64 {
    with(|r| {
        let id = r.next;
        r.next += 1;
        r.objects.insert(id, o);
        id
    })
}

fn closed(kind: &str, id: u64, found: Option<&Object>) -> Failure {
    let why = match found {
        Some(o) => format!("is an {}, not an {kind}", o.kind()),
        None if id == 0 => "is the null handle (0): open one first".to_string(),
        None => "is closed or was never opened".to_string(),
    };
    Failure::new(APD_ERR_CLOSED, format!("{kind} handle {id} {why}"))
}

macro_rules! accessors {
    ($get:ident, $remove:ident, $variant:ident, $ty:ty, $kind:literal) => {
        pub(crate) fn $get(id: u64) -> Result<$ty, Failure> {
            with(|r| match r.objects.get(&id) {
                Some(Object::$variant(x)) => Ok(x.clone()),
                other => Err(closed($kind, id, other)),
            })
        }

        pub(crate) fn $remove(id: u64) -> Result<$ty, Failure> {
            // Dropped by the caller outside the registry lock: closing a
            // sender or receiver joins its threads.
            with(|r| match r.objects.get(&id) {
                Some(Object::$variant(_)) => match r.objects.remove(&id) {
                    Some(Object::$variant(x)) => Ok(x),
                    _ => unreachable!("checked above"),
                },
                other => Err(closed($kind, id, other)),
            })
        }
    };
}

accessors!(config, remove_config, Config, Arc<PdConfig>, "ApdConfig");
accessors!(cache, remove_cache, Cache, Arc<SharedKvCache>, "ApdKvCache");
accessors!(sender, remove_sender, Sender, Arc<SenderObj>, "ApdSender");
accessors!(
    receiver,
    remove_receiver,
    Receiver,
    Arc<ReceiverObj>,
    "ApdReceiver"
);
