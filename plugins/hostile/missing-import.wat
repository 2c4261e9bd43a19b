;; A component that imports an interface the host does not provide: loading
;; it must fail with a link error, not crash the host.
(component
  (import "leasehold:turn/not-provided@0.1.0" (instance
    (export "nothing" (func))
  ))
)
