//! Mooncake's put options (`ReplicateConfig`, `SoftPinAction`,
//! `ObjectDataType`) and the put options they stand for.

use super::*;

/// What a soft pin does on put (Mooncake's `SoftPinAction`).
#[pyclass(
    module = "kvpool.mooncake",
    name = "SoftPinAction",
    eq,
    eq_int,
    from_py_object
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum SoftPinAction {
    PRESERVE = 0,
    ENABLE = 1,
    DISABLE = 2,
}

/// What an object holds (Mooncake's `ObjectDataType`; kvpool records
/// nothing of it).
#[pyclass(
    module = "kvpool.mooncake",
    name = "ObjectDataType",
    eq,
    eq_int,
    from_py_object
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum ObjectDataType {
    UNKNOWN = 0,
    KVCACHE = 1,
    TENSOR = 2,
    WEIGHT = 3,
    SAMPLE = 4,
    ACTIVATION = 5,
    GRADIENT = 6,
    OPTIMIZER_STATE = 7,
    METADATA = 8,
    GENERAL = 9,
}

/// How a put is placed (Mooncake's `ReplicateConfig`). kvpool uses
/// `replica_num`, the soft pin (`with_soft_pin`, or `soft_pin_action` ENABLE
/// with `soft_pin_ttl_ms`) and `with_hard_pin`; the other fields are kept
/// for compatibility and change nothing (placement is the master's:
/// same-host first; kvpool has no NVMe-oF or DFS replicas, no groups).
#[pyclass(
    module = "kvpool.mooncake",
    name = "ReplicateConfig",
    get_all,
    set_all,
    from_py_object
)]
#[derive(Clone, Debug)]
pub struct ReplicateConfig {
    pub(super) replica_num: u64,
    pub(super) nof_replica_num: u64,
    pub(super) dfs_replica_num: u64,
    pub(super) with_soft_pin: bool,
    pub(super) soft_pin_action: SoftPinAction,
    pub(super) soft_pin_ttl_ms: Option<u64>,
    pub(super) with_hard_pin: bool,
    pub(super) preferred_segments: Vec<String>,
    pub(super) preferred_segment: String,
    pub(super) preferred_nof_segments: Vec<String>,
    pub(super) prefer_alloc_in_same_node: bool,
    pub(super) data_type: ObjectDataType,
    pub(super) group_ids: Option<Vec<String>>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        Self {
            replica_num: 1,
            nof_replica_num: 0,
            dfs_replica_num: 0,
            with_soft_pin: false,
            soft_pin_action: SoftPinAction::PRESERVE,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segments: Vec::new(),
            preferred_segment: String::new(),
            preferred_nof_segments: Vec::new(),
            prefer_alloc_in_same_node: false,
            data_type: ObjectDataType::UNKNOWN,
            group_ids: None,
        }
    }
}

#[pymethods]
impl ReplicateConfig {
    #[new]
    pub(super) fn new() -> Self {
        Self::default()
    }

    pub(super) fn __str__(&self) -> String {
        format!(
            "ReplicateConfig: {{ replica_num: {}, with_soft_pin: {}, soft_pin_action: {:?}, \
             soft_pin_ttl_ms: {:?}, with_hard_pin: {}, preferred_segments: {:?}, \
             preferred_segment: {:?}, prefer_alloc_in_same_node: {} }}",
            self.replica_num,
            self.with_soft_pin,
            self.soft_pin_action,
            self.soft_pin_ttl_ms,
            self.with_hard_pin,
            self.preferred_segments,
            self.preferred_segment,
            self.prefer_alloc_in_same_node
        )
    }
}

impl ReplicateConfig {
    /// The put options; `Err(code)` for a config Mooncake refuses.
    pub(super) fn put_options(&self) -> Result<PutOptions, i64> {
        let soft = self.with_soft_pin || self.soft_pin_action == SoftPinAction::ENABLE;
        if self.soft_pin_ttl_ms.is_some() && !soft {
            return Err(INVALID_PARAMS);
        }
        let replicas = u32::try_from(self.replica_num).map_err(|_| INVALID_PARAMS)?;
        Ok(PutOptions {
            replicas,
            soft_pin_ttl_ms: if soft {
                self.soft_pin_ttl_ms.unwrap_or(DEFAULT_SOFT_PIN_TTL_MS)
            } else {
                0
            },
            hard_pin: self.with_hard_pin,
            ..PutOptions::default()
        })
    }
}

/// The options of `config` (None: the defaults) for a put, or with
/// `replace` an upsert; `Err(code)` when refused. `single` calls refuse
/// `prefer_alloc_in_same_node` as Mooncake does.
pub(super) fn options_of(
    config: Option<&ReplicateConfig>,
    single: bool,
    replace: bool,
) -> Result<PutOptions, i64> {
    let mut opts = match config {
        None => PutOptions::default(),
        Some(c) if single && c.prefer_alloc_in_same_node => return Err(INVALID_PARAMS),
        Some(c) => c.put_options()?,
    };
    opts.replace = replace;
    Ok(opts)
}
