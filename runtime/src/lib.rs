//! # yatt-runtime
//!
//! The actor runtime that carries every yatt role. It knows nothing of machine learning:
//! what belongs here is local actors with bounded mailboxes and supervision, actor
//! addressing (`node/role/replica` plus an incarnation), the directory of live actors
//! with its epoch, the QUIC transport with mutual TLS (frames, bulk payloads), cluster
//! membership with heartbeats, and remote spawn through a factory registry.
