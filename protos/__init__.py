"""Wire formats of the mesh.

`registry_pb2` holds our own etcd records (generated from `registry.proto`, committed).
`kserve` is the inference protocol: the Triton / KServe v2 messages and stubs from
`tritonclient.grpc`, plus the datatype table and the zero-copy tensor codec that the teacher
server and the student reader share.
`vllm` is vLLM's OpenAI-compatible scoring subset as JSON shapes, shared by the teacher's
`/v1/completions` and the student-side gateway (`distill gateway`).
"""
