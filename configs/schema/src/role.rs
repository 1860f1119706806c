//! What a `kvpool run` process runs: the one list of roles, for the CLI
//! (`--role`), the pool process, the serving roles and the logs.

use std::fmt;
use std::str::FromStr;

/// A role of `kvpool run --role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Master, one storage node and (unless `--no-serving`) the serving
    /// path, in one process.
    All,
    /// A master (its shards; on etcd with `--ha`).
    Master,
    /// A storage node: a DRAM segment (and an NVMe tier) given to the pool.
    Storage,
    /// A pool client with the RESP front only (`[resp]`, `--master`).
    Gateway,
    /// The inference engine (vLLM's HTTP subset), with the pool at `--master`.
    Engine,
    /// The OpenAI front and the scheduler over the proxies.
    Conductor,
    /// The proxy in front of a prefill engine.
    PrefillProxy,
    /// The proxy in front of a decode engine.
    DecodeProxy,
}

impl Role {
    /// Every role, in the order `--help` lists them.
    pub const ALL: [Role; 8] = [
        Role::All,
        Role::Master,
        Role::Storage,
        Role::Gateway,
        Role::Engine,
        Role::Conductor,
        Role::PrefillProxy,
        Role::DecodeProxy,
    ];

    /// Every role's name, in [`Role::ALL`]'s order.
    pub const NAMES: [&'static str; 8] = [
        "all",
        "master",
        "storage",
        "gateway",
        "engine",
        "conductor",
        "prefill-proxy",
        "decode-proxy",
    ];

    /// The name `--role` takes and the logs use.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Runs a master.
    pub fn runs_master(self) -> bool {
        matches!(self, Role::All | Role::Master)
    }

    /// Runs a storage node.
    pub fn runs_storage(self) -> bool {
        matches!(self, Role::All | Role::Storage)
    }

    /// Has a pool client of its own, so may serve RESP (`--resp`).
    pub fn may_serve_resp(self) -> bool {
        matches!(self, Role::All | Role::Storage | Role::Gateway)
    }

    /// Run by the pool process (`kvpool_node::run`): master, storage node,
    /// RESP gateway, or all of them.
    pub fn is_pool(self) -> bool {
        matches!(
            self,
            Role::All | Role::Master | Role::Storage | Role::Gateway
        )
    }

    /// Loads a model (role engine, and role all's two engines).
    pub fn takes_a_model(self) -> bool {
        matches!(self, Role::All | Role::Engine)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .position(|n| *n == s)
            .map(|i| Self::ALL[i])
            .ok_or_else(|| format!("unknown role `{s}`: one of {}", Self::NAMES.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_is_named_once_and_its_name_parses_back() {
        for (i, role) in Role::ALL.into_iter().enumerate() {
            assert_eq!(role as usize, i, "ALL is in declaration order");
            assert_eq!(role.name().parse::<Role>(), Ok(role));
        }
        let mut names = Role::NAMES.to_vec();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Role::ALL.len());
        let e = "prefill".parse::<Role>().unwrap_err();
        assert!(
            e.contains("unknown role `prefill`") && e.contains("decode-proxy"),
            "{e}"
        );
    }

    #[test]
    fn the_pool_process_runs_exactly_the_roles_with_a_master_storage_or_resp() {
        for role in Role::ALL {
            assert_eq!(
                role.is_pool(),
                role.runs_master() || role.runs_storage() || role.may_serve_resp(),
                "{role}"
            );
        }
    }
}
