//! What a certificate's holder may do. The kind is written into the certificate's
//! subject as an Organization (O) attribute, the way Kubernetes client certificates
//! carry their groups: the CA signs it, so a holder cannot raise its own kind, and
//! `openssl x509 -noout -subject` shows it.

use serde::{Deserialize, Serialize};

/// The kind of a certificate, and so of the node that holds it.
///
/// | kind | leads the directory | asks other nodes to spawn actors |
/// |---|---|---|
/// | `node` (a `yatt-node` daemon; its roles place helpers, e.g. a rollout its environment actors) | yes | yes |
/// | `trainer` (a `yatt train`, or a service that places roles) | no | yes |
/// | `client` (a service that only calls actors) | no | no |
///
/// Every kind may join, host actors, call actors and record its own actors in the
/// directory; no kind may change another node's entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CertKind {
    /// A daemon that hosts roles, may lead the directory and may spawn.
    Node,
    /// A program that places roles on the nodes (spawns them) and never leads.
    Trainer,
    /// A program that only calls actors: it neither spawns nor leads.
    Client,
}

/// The prefix of the Organization attribute that names the kind (`O=yatt-node`).
const ORGANIZATION_PREFIX: &str = "yatt-";

impl CertKind {
    /// Every kind, in the order the CLI lists them.
    pub const ALL: [CertKind; 3] = [CertKind::Node, CertKind::Trainer, CertKind::Client];

    /// The kind's name (`node`, `trainer`, `client`).
    pub fn name(self) -> &'static str {
        match self {
            CertKind::Node => "node",
            CertKind::Trainer => "trainer",
            CertKind::Client => "client",
        }
    }

    /// The certificate subject's Organization value for this kind.
    pub fn organization(self) -> String {
        format!("{ORGANIZATION_PREFIX}{}", self.name())
    }

    /// The kind an Organization value names, if any.
    pub fn from_organization(o: &str) -> Option<CertKind> {
        let name = o.strip_prefix(ORGANIZATION_PREFIX)?;
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether a holder may become the directory's leader (and so order its changes).
    pub fn may_lead(self) -> bool {
        matches!(self, CertKind::Node)
    }

    /// Whether a holder may ask another node to spawn an actor.
    pub fn may_spawn(self) -> bool {
        matches!(self, CertKind::Node | CertKind::Trainer)
    }
}

impl std::fmt::Display for CertKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CertKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!("unknown certificate kind {s:?}: expected node, trainer or client")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_organization_and_name() {
        for k in CertKind::ALL {
            assert_eq!(CertKind::from_organization(&k.organization()), Some(k));
            assert_eq!(k.name().parse::<CertKind>(), Ok(k));
        }
        assert_eq!(CertKind::from_organization("yatt-root"), None);
        assert_eq!(CertKind::from_organization("node"), None);
        assert!("operator"
            .parse::<CertKind>()
            .unwrap_err()
            .contains("node, trainer or client"));
    }

    #[test]
    fn only_nodes_lead_and_clients_never_spawn() {
        let lead: Vec<_> = CertKind::ALL.into_iter().filter(|k| k.may_lead()).collect();
        let spawn: Vec<_> = CertKind::ALL
            .into_iter()
            .filter(|k| k.may_spawn())
            .collect();
        assert_eq!(lead, [CertKind::Node]);
        assert_eq!(spawn, [CertKind::Node, CertKind::Trainer]);
    }
}
