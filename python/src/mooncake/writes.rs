//! The writes behind `put*` and `upsert*` (`replace`).

use super::*;

/// The writes behind `put*` and `upsert*` (`replace`).
impl Store {
    pub(super) fn write_value(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        config: Option<ReplicateConfig>,
        replace: bool,
    ) -> PyResult<i64> {
        let key = key_of(key)?;
        let mem = PyMem::readable(value)?;
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        let opts = match options_of(config.as_ref(), true, replace) {
            Ok(o) => o,
            Err(c) => return Ok(c),
        };
        let (addr, len) = (mem.addr, mem.len);
        let r = run(py, async move {
            // SAFETY: `mem` holds the export until after the call; read only.
            let v = unsafe { memory::slice(addr, len) };
            put_code(&inner.client.put_with(&key, v, &opts).await, &opts)
        });
        drop(mem);
        Ok(r.unwrap_or_else(|c| c))
    }

    pub(super) fn write_parts(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        parts: &Bound<'_, PyTuple>,
        config: Option<ReplicateConfig>,
        replace: bool,
    ) -> PyResult<i64> {
        let key = key_of(key)?;
        let mut value = Vec::new();
        for p in parts.iter() {
            let m = PyMem::readable(&p).map_err(|_| {
                pyo3::exceptions::PyRuntimeError::new_err("parts must be 1-D bytes-like")
            })?;
            // SAFETY: `m` holds the export while we copy, GIL held.
            value.extend_from_slice(unsafe { memory::slice(m.addr, m.len) });
        }
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        let opts = match options_of(config.as_ref(), true, replace) {
            Ok(o) => o,
            Err(c) => return Ok(c),
        };
        let r = run(py, async move {
            put_code(&inner.client.put_with(&key, &value, &opts).await, &opts)
        });
        Ok(r.unwrap_or_else(|c| c))
    }

    pub(super) fn write_batch(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        config: Option<ReplicateConfig>,
        replace: bool,
    ) -> PyResult<i64> {
        let keys = keys_of(keys)?;
        let mems: Vec<PyMem> = values
            .try_iter()?
            .map(|v| PyMem::readable(&v?))
            .collect::<PyResult<_>>()?;
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        if keys.len() != mems.len() {
            return Ok(INVALID_PARAMS);
        }
        let opts = match options_of(config.as_ref(), true, replace) {
            Ok(o) => o,
            Err(c) => return Ok(c),
        };
        let ranges: Vec<(usize, usize)> = mems.iter().map(|m| (m.addr, m.len)).collect();
        let r = run(py, async move {
            // SAFETY: `mems` hold the exports until after the call; read only.
            let values: Vec<&[u8]> = ranges
                .iter()
                .map(|&(a, l)| unsafe { memory::slice(a, l) })
                .collect();
            let codes = batch_put(&inner.client, &keys, &values, &opts).await;
            codes.into_iter().find(|&c| c != OK).unwrap_or(OK)
        });
        drop(mems);
        Ok(r.unwrap_or_else(|c| c))
    }

    pub(super) fn write_from(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        buffer_ptr: usize,
        size: usize,
        config: Option<ReplicateConfig>,
        replace: bool,
    ) -> PyResult<i64> {
        let key = key_of(key)?;
        let Some(inner) = self.state() else {
            return Ok(INVALID_PARAMS);
        };
        if size == 0 {
            return Ok(OK);
        }
        let opts = match options_of(config.as_ref(), true, replace) {
            Ok(o) => o,
            Err(c) => return Ok(c),
        };
        if !inner.regs.covers(buffer_ptr, size) {
            return Ok(mooncake_code(&memory::unregistered(buffer_ptr, size)));
        }
        let part = vec![(buffer_ptr, size)];
        if let Some(dev) = inner.regs.device_of(&part) {
            let r = py
                .detach(|| staged::put(&inner.client, &inner.staging, dev, &[key], &[part], &opts));
            return Ok(put_code(&r[0], &opts));
        }
        let r = run(py, async move {
            // SAFETY: Mooncake's contract for `put_from`: the range lies in
            // registered memory (checked) that the caller keeps valid and
            // does not write during the call.
            let v = unsafe { memory::slice(buffer_ptr, size) };
            put_code(&inner.client.put_with(&key, v, &opts).await, &opts)
        });
        Ok(r.unwrap_or_else(|c| c))
    }

    pub(super) fn write_batch_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<ReplicateConfig>,
        replace: bool,
    ) -> PyResult<Vec<i64>> {
        let keys = keys_of(keys)?;
        let n = keys.len();
        let Some(inner) = self.state() else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        let Some(parts) = one_part_each(n, buffer_ptrs, sizes) else {
            return Ok(vec![INVALID_PARAMS; n]);
        };
        let opts = match options_of(config.as_ref(), true, replace) {
            Ok(o) => o,
            Err(c) => return Ok(vec![c; n]),
        };
        Ok(put_multi(py, inner, keys, parts, opts))
    }
}
