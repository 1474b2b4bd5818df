//! Router-native flow, the wire side: a decode's [`RegisterDecode`] for a
//! transfer a prefill parked, and the prefill's [`RegisterDecodeAck`].
//!
//! A registration decides where a prompt's KV goes, so with a deployment
//! secret both frames are sealed. There is no attachment between the two
//! sides yet (the decode calls first), so the seal is one-shot: the
//! registration carries a fresh nonce and a proof over it and the message
//! ([`Step::Register`]); the answer carries a proof over that nonce and
//! its own message ([`Step::RegisterAnswer`]). The prefill drops (and
//! counts) a frame whose proof fails or whose nonce it saw before; a
//! replayed registration could only name the same transfer again anyway,
//! and a transfer attaches once.
//!
//! Sealed frame: `MAGIC ‖ nonce (16) ‖ proof (32) ‖ message`; answer:
//! `MAGIC ‖ proof (32) ‖ message`. Without a secret, frames are the bare
//! msgpack messages.

use super::zmq_io::ReqClient;
use super::BackendError;
use crate::auth::{Secret, Step, NONCE_LEN, PROOF_LEN};
use crate::protocol::{RegisterDecode, RegisterDecodeAck};
use std::time::Duration;

/// The first bytes of a sealed registration frame (msgpack maps never
/// start with them: 0xA5 would be a 5-byte string).
const MAGIC: &[u8; 4] = b"\xa5PDR";

/// Why a registration frame was not acted on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not sealed, or its proof does not verify (forged, or another secret).
    Forged,
    /// Its nonce was seen before.
    Replayed,
    /// Not a registration message.
    Malformed(String),
}

/// The deployment secret (if any) and the host a worker of `config` binds
/// and names in registrations (`pd_peer_host`, else loopback).
pub(crate) fn secret_and_host(
    config: &crate::config::PdConfig,
) -> Result<(Option<Secret>, String), BackendError> {
    let secret = Secret::from_env_or(config.auth_secret_file.as_deref())
        .map_err(|e| BackendError::Setup(e.to_string()))?;
    let host = config
        .peer_host
        .clone()
        .unwrap_or_else(|| "127.0.0.1".to_string());
    Ok((secret, host))
}

/// Encodes `msg` as the decode sends it; with a secret, also the nonce the
/// answer's proof must cover.
pub(crate) fn seal_request(
    secret: Option<&Secret>,
    msg: &RegisterDecode,
) -> (Vec<u8>, Option<crate::auth::Nonce>) {
    let body = msg.encode();
    let Some(secret) = secret else {
        return (body, None);
    };
    let nonce = crate::auth::nonce();
    let proof = secret.prove(Step::Register, &[&nonce, &body]);
    let mut frame = Vec::with_capacity(MAGIC.len() + NONCE_LEN + PROOF_LEN + body.len());
    frame.extend_from_slice(MAGIC);
    frame.extend_from_slice(&nonce);
    frame.extend_from_slice(&proof);
    frame.extend_from_slice(&body);
    (frame, Some(nonce))
}

/// Opens a registration frame on the prefill side: the message, and the
/// nonce its answer must be sealed over. `seen` says whether a nonce was
/// seen before (and remembers it).
pub(crate) fn open_request(
    secret: Option<&Secret>,
    frame: &[u8],
    seen: impl FnOnce(&[u8]) -> bool,
) -> Result<(RegisterDecode, Option<crate::auth::Nonce>), Refused> {
    let (body, nonce) = match secret {
        None => (frame, None),
        Some(secret) => {
            let head = MAGIC.len() + NONCE_LEN + PROOF_LEN;
            if frame.len() < head || &frame[..MAGIC.len()] != MAGIC {
                return Err(Refused::Forged);
            }
            let nonce: crate::auth::Nonce = frame[MAGIC.len()..MAGIC.len() + NONCE_LEN]
                .try_into()
                .expect("sliced to NONCE_LEN");
            let proof = &frame[MAGIC.len() + NONCE_LEN..head];
            let body = &frame[head..];
            if !secret.verify(Step::Register, &[&nonce, body], proof) {
                return Err(Refused::Forged);
            }
            if seen(&nonce) {
                return Err(Refused::Replayed);
            }
            (body, Some(nonce))
        }
    };
    RegisterDecode::decode(body)
        .map(|m| (m, nonce))
        .map_err(|e| Refused::Malformed(e.to_string()))
}

/// Encodes the prefill's answer (sealed over the registration's nonce).
pub(crate) fn seal_answer(
    secret: Option<&Secret>,
    nonce: Option<&crate::auth::Nonce>,
    ack: &RegisterDecodeAck,
) -> Vec<u8> {
    let body = ack.encode();
    match (secret, nonce) {
        (Some(secret), Some(nonce)) => {
            let proof = secret.prove(Step::RegisterAnswer, &[nonce, &body]);
            let mut frame = Vec::with_capacity(MAGIC.len() + PROOF_LEN + body.len());
            frame.extend_from_slice(MAGIC);
            frame.extend_from_slice(&proof);
            frame.extend_from_slice(&body);
            frame
        }
        _ => body,
    }
}

/// Opens the prefill's answer on the decode side.
pub(crate) fn open_answer(
    secret: Option<&Secret>,
    nonce: Option<&crate::auth::Nonce>,
    frame: &[u8],
) -> Result<RegisterDecodeAck, String> {
    let body = match (secret, nonce) {
        (Some(secret), Some(nonce)) => {
            let head = MAGIC.len() + PROOF_LEN;
            if frame.len() < head
                || &frame[..MAGIC.len()] != MAGIC
                || !secret.verify(
                    Step::RegisterAnswer,
                    &[nonce, &frame[head..]],
                    &frame[MAGIC.len()..head],
                )
            {
                return Err(
                    "the prefill's answer is not sealed with this deployment's secret \
                            (is pd_auth_secret_file the same file on the prefill and the decode?)"
                        .into(),
                );
            }
            &frame[head..]
        }
        _ => frame,
    };
    RegisterDecodeAck::decode(body).map_err(|e| format!("the prefill's answer is malformed: {e}"))
}

/// Sends `msg` to the prefill rank at `url` (`tcp://host:port`) and waits
/// (at most `timeout`) for its answer: `Ok(())` when it accepted, else why
/// not, naming the fix.
pub(crate) fn register(
    ctx: &zmq::Context,
    secret: Option<&Secret>,
    url: &str,
    msg: &RegisterDecode,
    route: &str,
    timeout: Duration,
) -> Result<(), String> {
    let (frame, nonce) = seal_request(secret, msg);
    let mut client = ReqClient::new(ctx, url, timeout);
    let reply = client
        .request(route, &frame, "RegisterDecode")
        .map_err(|f| {
            let e: BackendError = f.into_error();
            format!(
                "no answer from the prefill's registration port {url}: {e} (is the prefill \
                 alive, does this host reach it, and do both sides use the same \
                 pd_auth_secret_file?)"
            )
        })?;
    let ack = open_answer(secret, nonce.as_ref(), &reply)?;
    if ack.accepted {
        Ok(())
    } else {
        Err(ack.error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg() -> RegisterDecode {
        RegisterDecode {
            transfer_id: "req-1".into(),
            receiver_host: "10.0.0.2".into(),
            receiver_init_port: vec![7100, 7101],
            receiver_alloc_port: vec![7200, 7201],
            held_tokens: 512,
        }
    }

    #[test]
    fn registrations_round_trip_bare_and_sealed() {
        let (frame, nonce) = seal_request(None, &msg());
        assert!(nonce.is_none());
        assert_eq!(open_request(None, &frame, |_| false), Ok((msg(), None)));
        let secret = Secret::from_bytes(&[7u8; 32]).unwrap();
        let (frame, nonce) = seal_request(Some(&secret), &msg());
        let (got, n) = open_request(Some(&secret), &frame, |_| false).unwrap();
        assert_eq!((got, n), (msg(), nonce));
        let ack = RegisterDecodeAck {
            accepted: false,
            error: "expired".into(),
        };
        let answer = seal_answer(Some(&secret), nonce.as_ref(), &ack);
        assert_eq!(open_answer(Some(&secret), nonce.as_ref(), &answer), Ok(ack));
    }

    #[test]
    fn forged_replayed_and_altered_registrations_are_refused() {
        let secret = Secret::from_bytes(&[7u8; 32]).unwrap();
        let other = Secret::from_bytes(&[8u8; 32]).unwrap();
        // Bare frame to a prefill with a secret.
        let (bare, _) = seal_request(None, &msg());
        assert_eq!(
            open_request(Some(&secret), &bare, |_| false),
            Err(Refused::Forged)
        );
        // Sealed with another secret.
        let (forged, _) = seal_request(Some(&other), &msg());
        assert_eq!(
            open_request(Some(&secret), &forged, |_| false),
            Err(Refused::Forged)
        );
        // One byte of the message changed (another receiver host).
        let (mut altered, _) = seal_request(Some(&secret), &msg());
        let last = altered.len() - 1;
        altered[last] ^= 1;
        assert_eq!(
            open_request(Some(&secret), &altered, |_| false),
            Err(Refused::Forged)
        );
        let (frame, _) = seal_request(Some(&secret), &msg());
        assert_eq!(
            open_request(Some(&secret), &frame, |_| true),
            Err(Refused::Replayed)
        );
        // An answer sealed over another nonce.
        let (_, n1) = seal_request(Some(&secret), &msg());
        let (_, n2) = seal_request(Some(&secret), &msg());
        let answer = seal_answer(
            Some(&secret),
            n1.as_ref(),
            &RegisterDecodeAck {
                accepted: true,
                error: String::new(),
            },
        );
        assert!(open_answer(Some(&secret), n2.as_ref(), &answer).is_err());
    }
}
