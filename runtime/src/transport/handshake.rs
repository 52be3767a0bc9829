//! What a failed handshake means to a user. A peer of another yatt build offers another
//! ALPN ([`crate::ALPN`] names the wire protocol), and TLS refuses it with the alert
//! `no_application_protocol`: without this, the user reads "crypto error 120" on one side
//! and nothing useful on the other.

use crate::tls::ALPN;

/// TLS alert 120 (`no_application_protocol`) as a QUIC error code (0x100 + alert).
fn other_protocol_code() -> quinn_proto::TransportErrorCode {
    quinn_proto::TransportErrorCode::crypto(120)
}

/// Whether the handshake failed because the two sides speak different yatt wire
/// protocols.
pub(crate) fn is_other_protocol(e: &quinn::ConnectionError) -> bool {
    match e {
        quinn::ConnectionError::ConnectionClosed(c) => c.error_code == other_protocol_code(),
        quinn::ConnectionError::TransportError(t) => t.code == other_protocol_code(),
        _ => false,
    }
}

/// `e` with what to do about it when it is a wire-protocol mismatch.
pub(crate) fn explain(e: &quinn::ConnectionError) -> String {
    match is_other_protocol(e) {
        true => format!(
            "{e}: the peer runs a yatt build whose wire protocol is not this one's ({}); run the same yatt build on every node",
            String::from_utf8_lossy(ALPN)
        ),
        false => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::cert_kind::CertKind;
    use crate::tls::test_support::{client, server};
    use crate::tls::{ClusterCa, SERVER_NAME};

    /// A node of an older build (its ALPN `yatt/1`) dialing this one is refused at the
    /// handshake, and both sides say why.
    #[tokio::test]
    async fn a_peer_of_another_wire_protocol_is_refused_naming_it() {
        let ca = ClusterCa::generate("test").unwrap();
        let here = ca.issue("node-a", CertKind::Node).unwrap();
        let old = ca.issue("node-b", CertKind::Node).unwrap();
        let mut tls = old.rustls_client_config().unwrap();
        tls.alpn_protocols = vec![b"yatt/1".to_vec()];
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
        let srv = server(&here);
        let addr = srv.local_addr().unwrap();
        let accepted = tokio::spawn(async move {
            let incoming = srv.accept().await.expect("a connection attempt");
            incoming.await.map(drop)
        });
        let cli = client(quinn::ClientConfig::new(Arc::new(quic)));
        let dialed = tokio::time::timeout(
            Duration::from_secs(10),
            cli.connect(addr, SERVER_NAME).unwrap(),
        )
        .await
        .expect("the handshake ends");
        let e = dialed
            .err()
            .expect("a peer of another protocol was accepted");
        assert!(is_other_protocol(&e), "{e:?}");
        let said = explain(&e);
        assert!(
            said.contains("wire protocol") && said.contains(&*String::from_utf8_lossy(ALPN)),
            "{said}"
        );
        let e = accepted.await.unwrap().expect_err("the server accepted it");
        assert!(is_other_protocol(&e), "{e:?}");
        // Any other failure reads as it is.
        let closed = quinn::ConnectionError::LocallyClosed;
        assert_eq!(explain(&closed), closed.to_string());
    }
}
