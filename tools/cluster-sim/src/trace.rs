//! Requests, answers and replicas in the few words a violation's text and
//! the trace print.

use kvpool_wire::proto::{DataRequest, MasterRequest, MasterResponse, NvmeUpdate, ObjectInfo};

/// A data request in a violation's text.
pub(crate) fn describe(req: &DataRequest) -> String {
    match req {
        DataRequest::Write {
            segment_id,
            offset,
            len,
            ..
        } => format!("a Write of {offset}+{len} on segment {segment_id:016x}"),
        DataRequest::Read {
            segment_id,
            offset,
            len,
            ..
        } => format!("a Read of {offset}+{len} on segment {segment_id:016x}"),
        DataRequest::ReadNvme {
            segment_id,
            loc,
            len,
            ..
        } => format!("a ReadNvme of {len} bytes at {loc} on segment {segment_id:016x}"),
        other => format!("{other:?}"),
    }
}

pub(crate) fn replicas_of(i: &Option<ObjectInfo>) -> String {
    match i {
        None => "-".into(),
        Some(i) => {
            let parts: Vec<String> = i
                .replicas
                .iter()
                .map(|d| format!("{:?} {:04x}@{}", d.tier, d.segment_id & 0xffff, d.offset))
                .collect();
            format!(
                "{}[{}]",
                if i.complete { "" } else { "putting " },
                parts.join(" ")
            )
        }
    }
}

pub(crate) fn describe_req(req: &MasterRequest) -> String {
    match req {
        MasterRequest::NvmeUpdates { updates, .. } => {
            let parts: Vec<String> = updates.iter().map(short_update).collect();
            format!("nvme_updates [{}]", parts.join(", "))
        }
        r => match (r.key(), r.batch_keys()) {
            (Some(k), _) => format!("{} {}", r.op_name(), String::from_utf8_lossy(k)),
            (None, Some(keys)) => {
                let keys: Vec<_> = keys.iter().map(|k| String::from_utf8_lossy(k)).collect();
                format!("{} [{}]", r.op_name(), keys.join(" "))
            }
            (None, None) => r.op_name().to_string(),
        },
    }
}

fn short_update(u: &NvmeUpdate) -> String {
    let k = String::from_utf8_lossy(u.key());
    match u {
        NvmeUpdate::Stored {
            loc,
            demote,
            offset,
            ..
        } => {
            format!("Stored {k} loc {loc} from {offset} demote {demote}")
        }
        NvmeUpdate::Promoted { offset, ok, .. } => format!("Promoted {k} at {offset} ok {ok}"),
        NvmeUpdate::PersistFailed { offset, .. } => format!("PersistFailed {k} at {offset}"),
        NvmeUpdate::Evicted { loc, .. } => format!("Evicted {k} loc {loc}"),
        NvmeUpdate::Recovered { loc, .. } => format!("Recovered {k} loc {loc}"),
    }
}

pub(crate) fn short_resp(r: &MasterResponse) -> String {
    match r {
        MasterResponse::Replicas(v) => {
            let parts: Vec<String> = v
                .iter()
                .map(|d| format!("{:?} {:04x}@{}", d.tier, d.segment_id & 0xffff, d.offset))
                .collect();
            format!("[{}]", parts.join(" "))
        }
        MasterResponse::Tasks(t) => format!("{} tasks", t.len()),
        MasterResponse::BatchDone(v) => {
            // The refused items, each with the start of its reason.
            let refused: Vec<String> = v
                .iter()
                .enumerate()
                .filter_map(|(i, r)| match r {
                    kvpool_wire::proto::ItemResult::Ok(_) => None,
                    kvpool_wire::proto::ItemResult::Err(e) => Some(format!(
                        "#{i}: {}",
                        e.message.chars().take(90).collect::<String>()
                    )),
                })
                .collect();
            let ok = v.len() - refused.len();
            match refused.is_empty() {
                true => format!("{ok}/{} ok", v.len()),
                false => format!("{ok}/{} ok; {}", v.len(), refused.join("; ")),
            }
        }
        other => {
            let s = format!("{other:?}");
            s.chars().take(60).collect()
        }
    }
}
